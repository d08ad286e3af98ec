"""Rank 0's side of a parallel step: it tells the other ranks what to do, then does its own part.

Every command is a broadcast over the world group (engine/parallel/step_codec.py); the ranks answer in
the collectives of the forward pass itself (the all-reduces, the pipeline sends) and of the logits.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.parallel.group import RankGroup
from pdserve.engine.parallel.kv_ranks import RankConnector, broadcast_bytes, recv_bytes, share_failed_loads
from pdserve.engine.parallel.launcher import RankProcesses
from pdserve.engine.parallel.layout import ParallelLayout
from pdserve.engine.parallel.stage import StageExecutor
from pdserve.engine.parallel.step_codec import Command, StepLayout, header

logger = logging.getLogger(__name__)


def start_ranks(config: EngineConfig, layout: ParallelLayout,
                connector_factory: str | None = None) -> tuple[RankProcesses, RankGroup]:
    """Start ranks 1..N-1, join them (deadline: distributed_timeout_s) and make rank 0's groups."""
    for line in layout.describe():
        logger.info("%s", line)
    ranks = RankProcesses(config, connector_factory)
    try:
        ranks.wait_joined()
        group = RankGroup(ranks.store, layout, config.parallel.distributed_timeout_s)
    except BaseException:
        ranks.kill()
        raise
    ranks.supervise()
    return ranks, group


class ParallelDriver:
    def __init__(self, ranks: RankProcesses, group: RankGroup, stage: StageExecutor) -> None:
        self.ranks, self.group, self.stage = ranks, group, stage
        self.kv: RankConnector | None = None  # with a KV connector: its message rides every step
        self.closed = False

    def _command(self, h: torch.Tensor, payload: torch.Tensor | None = None, message: bytes | None = None) -> None:
        self.ranks.check()
        try:
            self.group.broadcast(h)
            if payload is not None:
                self.group.broadcast(payload)
            if message:
                broadcast_bytes(self.group, message, len(message))
        except RuntimeError as e:
            raise self.ranks.failed(e, "a rank did not take the step") from None

    def forward(self, layout: StepLayout, run: Callable[[Any], Any]) -> torch.Tensor:
        """Send the step, run rank 0's stage; the final hidden rows (all, or layout.keep_rows)."""
        message = self.kv.step_message() if self.kv is not None else None
        self._command(*layout.encode(len(message or b"")), message=message)
        num_tokens = layout.input_ids.numel()
        num_final = num_tokens if layout.keep_rows is None else layout.keep_rows.numel()
        try:
            return self.stage.forward(run, num_tokens, num_final)
        except RuntimeError as e:
            raise self.ranks.failed(e, "a collective of the step failed") from None

    def compute_logits(self, model: Any, hidden: torch.Tensor) -> torch.Tensor:
        """The full logits of `hidden`'s rows; with tensor parallelism each rank computes its vocabulary part."""
        if self.group.layout.tp == 1:
            return model.compute_logits(hidden)
        hidden = hidden.contiguous()
        self._command(header(Command.LOGITS, hidden.shape[0], hidden.shape[1]), hidden)
        try:
            return model.compute_logits(hidden)
        except RuntimeError as e:
            raise self.ranks.failed(e, "the logits' all-gather failed") from None

    def send_connector_step(self, message: bytes) -> None:
        """A step that computed nothing: the other ranks' connectors still poll their I/O."""
        self._command(header(Command.CONNECTOR, len(message)), message=message)

    def collect_reports(self) -> list[bytes]:
        """Each other rank's connector report of this step (engine/parallel/kv_ranks.py), in rank order."""
        try:
            return [recv_bytes(self.group, rank) for rank in range(1, self.group.layout.world_size)]
        except RuntimeError as e:
            raise self.ranks.failed(e, "a rank's connector report did not arrive") from None

    def share_failed_loads(self, own: set[str]) -> set[str]:
        """Every rank's failed loads of this step (kv_ranks.share_failed_loads), before its saves."""
        try:
            return share_failed_loads(self.group, own)
        except RuntimeError as e:
            raise self.ranks.failed(e, "a rank's failed loads did not arrive") from None

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self._command(header(Command.COPY, len(pairs)), torch.tensor(pairs, dtype=torch.int64).reshape(-1))

    def close(self) -> None:
        """Stop the other ranks (STOP, then wait; killed past a deadline). Safe to call twice."""
        if self.closed:
            return
        self.closed = True
        if self.ranks.failure is None:
            try:
                self.group.broadcast(header(Command.STOP))
            except RuntimeError:
                pass
        self.ranks.stop()
        self.group.shutdown()
