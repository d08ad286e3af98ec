"""Per-part wall time of a benchmark's runs: wrap the methods that make up each part, sum their time.

The engine is synchronous on CPU (each call returns when its work is done), so wall time inside a
call is that part's cost. Used for the per-part breakdowns of decode_step.py and kv_handoff.py.
"""
from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable


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
