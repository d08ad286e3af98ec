"""One proxied request's latencies and token counts as its client sees them, on the proxy's /metrics."""
from __future__ import annotations

import contextlib
import time
from typing import AsyncIterator

from pdserve.protos import pdserve_pb2 as pb
from pdserve.serving.metrics import RequestMetrics


class Meter:
    """One request's latencies and token counts as its client sees them, on the proxy's /metrics (pd-serve's
    families: serving/metrics.py RequestMetrics)."""

    def __init__(self, metrics: RequestMetrics, model: str, t0: float) -> None:
        self.metrics = metrics
        self.model = model
        self.t0 = t0
        self._last: dict[tuple[int, int], float] = {}  # (prompt, choice): when its last tokens came

    async def deltas(self, outputs: AsyncIterator[tuple[int, pb.GenerateDelta]]
                     ) -> AsyncIterator[tuple[int, pb.GenerateDelta]]:
        async with contextlib.aclosing(outputs):
            async for p, d in outputs:
                if d.token_ids:
                    now = time.perf_counter()
                    last = self._last.get((p, d.index))
                    self.metrics.observe_tokens(self.model, now - (self.t0 if last is None else last),
                                                len(d.token_ids), last is None)
                    self._last[(p, d.index)] = now
                yield p, d

    def finished(self, usage: dict, outcome: str) -> None:
        self.metrics.observe_finished(self.model, time.perf_counter() - self.t0, usage["prompt_tokens"],
                                      usage["completion_tokens"])
        self.metrics.record_outcome(self.model, outcome)
