"""One rank's part of a step's forward pass, the same code on every rank.

A pipeline stage other than the first receives the previous stage's (hidden, residual) rows, runs its
layers and sends them on; the last stage's final hidden rows (those kept past the last layer) go back to
rank 0, which samples: sampling needs the requests' state (seeds, penalties, grammars), which lives with
the scheduler. Without microbatching only one stage computes at a time (docs/parallelism.md).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pdserve.engine.parallel.group import RankGroup


class StageExecutor:
    def __init__(self, group: RankGroup, hidden_size: int, dtype: torch.dtype, carries_residual: bool) -> None:
        self.group, self.layout = group, group.layout
        self.hidden_size, self.dtype = hidden_size, dtype
        self.carries_residual = carries_residual

    def _rows(self, n: int) -> torch.Tensor:
        return torch.empty(n, self.hidden_size, dtype=self.dtype)

    def forward(self, run: Callable[[Any], Any], num_tokens: int, num_final: int) -> torch.Tensor | None:
        """`run(carry)` runs this rank's layers; rank 0 gets the final hidden rows [num_final, hidden]."""
        lay, group = self.layout, self.group
        carry = None
        if not lay.is_first_stage:
            src = lay.rank - lay.tp
            x = group.recv(self._rows(num_tokens), src)
            carry = (x, group.recv(self._rows(num_tokens), src) if self.carries_residual else None)
        out = run(carry)
        if lay.is_last_stage:
            if lay.rank != 0 and lay.tp_rank == 0 and lay.pp > 1:
                group.send(out, 0)
            return out if lay.rank == 0 else None
        x, residual = out
        group.send(x, lay.rank + lay.tp)
        if self.carries_residual:
            group.send(residual, lay.rank + lay.tp)
        if lay.rank == 0:
            return group.recv(self._rows(num_final), (lay.pp - 1) * lay.tp)
        return None
