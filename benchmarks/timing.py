"""Per-part wall time of a benchmark's runs: wrap the methods that make up each part, sum their time.

The engine is synchronous on CPU (each call returns when its work is done), so wall time inside a
call is that part's cost. Used for the per-part breakdowns of decode_step.py, engine_throughput.py
and kv_handoff.py.
"""
from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any


class PartTimer:
    """Sums wall seconds per part. A call made while another `exclusive` part is running is not
    counted again when it is exclusive itself (e.g. the lm_head Linear inside compute_logits)."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self._depth = 0

    def wrap(self, owner: type | object, method: str, part: str, exclusive: bool = True) -> None:
        """Time `owner.method` (a class: every instance; an object: that one) as `part`."""
        original: Callable = getattr(owner, method)
        timer = self

        def timed(*args, **kwargs):
            if exclusive and timer._depth:
                return original(*args, **kwargs)
            timer._depth += exclusive
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                timer.totals[part] += time.perf_counter() - start
                timer._depth -= exclusive

        setattr(owner, method, timed)

    def reset(self) -> None:
        self.totals = defaultdict(float)


def engine_parts(runner: Any) -> PartTimer:
    """Time a model runner's forward pass by part: attention, linear layers, logits + sampling (the
    rest of a run is embedding, norms, RoPE, scheduling and building inputs and outputs)."""
    from pdserve.engine.attention import PagedAttention
    from pdserve.engine.models.linear import Linear

    timer = PartTimer()
    timer.wrap(PagedAttention, "forward", "attention")
    timer.wrap(Linear, "forward", "linear layers")
    timer.wrap(runner.model, "compute_logits", "logits + sampling")
    timer.wrap(runner.sampler, "__call__", "logits + sampling")
    return timer


def print_parts(parts: dict[str, float], total: float, per: int = 1, unit: str = "ms per step") -> None:
    """A markdown table of `parts` (seconds) and the rest of `total`, `per` runs or steps each."""
    rows = {k: v for k, v in parts.items()}
    rows["rest (embedding, norms, RoPE, scheduler, inputs, outputs)"] = total - sum(parts.values())
    print(f"| part | {unit} | share |")
    print("|---|---|---|")
    for name, seconds in sorted(rows.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {1000 * seconds / per:.2f} | {100 * seconds / total:.0f}% |")
