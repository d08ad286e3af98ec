"""The scheduler half shared by every chunked connector (store and LMCache).

Both connectors answer the same questions with the arithmetic of docs/architecture.md; they
differ only in how a prompt's present chunk prefix is looked up and how bytes move. This
class owns the per-request bookkeeping (load plan, save progress) and the step metadata;
subclasses implement `lookup_hit` and the worker half.
"""
from __future__ import annotations

import logging
import threading
import time
from abc import abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from connectors.chunk_math import LoadPlan, save_range, slots_for
from connectors.kv_metrics import KVTransferMetrics
from engine.config import KVRole
from engine.kv_connector import KVConnectorBase, KVConnectorMetadata

if TYPE_CHECKING:
    from engine.request import Request
    from engine.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass
class LoadSpec:
    """Load tokens plan.write_range of one request; `slots` are their paged-KV slots (new blocks only)."""

    request_id: str
    token_ids: list[int]  # the prompt
    cache_salt: str | None
    plan: LoadPlan
    slots: torch.Tensor


@dataclass
class SaveSpec:
    """Store prompt tokens [start, end) (whole chunks; `end` may be the partial last chunk's end)."""

    request_id: str
    token_ids: list[int]  # the prompt
    cache_salt: str | None
    start: int
    end: int
    skip_leading_tokens: int
    slots: torch.Tensor  # slots of tokens [start, end)


@dataclass
class ChunkedConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class InFlightLoad:
    """One request's load in the current step. `failed` is set once, under `lock`, and after that no
    background copy may write into the request's blocks (the engine recomputes them)."""

    spec: LoadSpec
    lock: threading.Lock = field(default_factory=threading.Lock)
    num_bytes: int = 0
    started: float = field(default_factory=time.perf_counter)
    finished: float = 0.0  # when the last copy into paged memory ended
    failed: bool = False

    @property
    def io_seconds(self) -> float:
        """From the start of the load to its last copy (reads overlap compute, so this is not added latency)."""
        return max(0.0, self.finished - self.started)


@dataclass
class _RequestState:
    plan: LoadPlan | None = None
    pending_load: LoadSpec | None = None
    skip_leading_tokens: int = 0  # chunk-aligned prefix already in the store: never written again
    saved_end: int = 0  # prompt tokens stored (or handed to the worker) so far
    awaiting_alloc: bool = False  # looked up, not yet admitted: a retry must not ask the store again


class ChunkedConnector(KVConnectorBase):
    """Scheduler-side bookkeeping over a store of prompt chunks of `chunk_size` tokens."""

    def __init__(self, role: KVRole, chunk_size: int, block_size: int,
                 metrics: KVTransferMetrics | None = None) -> None:
        super().__init__(role)
        self.chunk_size = chunk_size
        self.block_size = block_size
        self.metrics = metrics or KVTransferMetrics(role.value)
        self._requests: dict[str, _RequestState] = {}
        self._failed: set[str] = set()  # loads that failed in the current step
        self._step_saves: list[SaveSpec] = []

    # ---- subclass hooks ----
    @abstractmethod
    def lookup_hit(self, request: Request) -> int:
        """H: prompt tokens covered by the longest run of present chunks; raises on store failure."""

    def _failure_reason(self, exc: BaseException) -> str:
        """Short '<kind>: <detail>' text for the fallback line; the kind becomes the metric label."""
        return f"error: {type(exc).__name__}: {exc}"

    # ---- scheduler side ----
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        state = self._requests.setdefault(request.request_id, _RequestState())
        if state.awaiting_alloc and state.plan is not None and state.plan.num_local == num_computed_tokens:
            # The scheduler retries a request that found no free blocks every step: same answer, no new I/O.
            return (state.plan.need_to_load if self.role.loads else 0), False
        num_tokens = request.num_prompt_tokens
        try:
            hit = self.lookup_hit(request)
        except Exception as exc:  # any lookup failure means "recompute", never a failed request
            hit = 0
            if self.role.loads:
                self.metrics.on_fallback(request.request_id, self._failure_reason(exc),
                                         max(0, num_tokens - 1 - num_computed_tokens))
            else:
                logger.warning("Reqid: %s, KV lookup failed (%s); saving every chunk", request.request_id,
                               self._failure_reason(exc))
        plan = LoadPlan(num_tokens, num_computed_tokens, hit, self.chunk_size)
        state.plan = plan
        state.awaiting_alloc = True
        if self.role.saves:
            state.skip_leading_tokens = hit
        if not self.role.loads:
            return 0, False
        self.metrics.on_lookup(request.request_id, plan)
        return plan.need_to_load, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is None:
            return
        state.awaiting_alloc = False
        if state.plan is None or num_external_tokens <= 0:
            return
        plan = state.plan
        if num_external_tokens != plan.need_to_load:
            raise ValueError(f"request {request.request_id}: {num_external_tokens} external tokens allocated, "
                             f"the connector offered {plan.need_to_load}")
        start, end = plan.write_range
        state.pending_load = LoadSpec(request.request_id, list(request.prompt_token_ids), request.cache_salt,
                                      plan, slots_for(block_ids, start, end, self.block_size))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ChunkedConnectorMetadata:
        meta = ChunkedConnectorMetadata()
        for request in scheduler_output.scheduled_requests:
            rid = request.request_id
            state = self._requests.get(rid)
            if state is None:
                continue
            if state.pending_load is not None:
                meta.loads.append(state.pending_load)
                state.pending_load = None
            if self.role.saves:
                spec = self._save_spec(request, state, scheduler_output)
                if spec is not None:
                    meta.saves.append(spec)
        return meta

    def _save_spec(self, request: Request, state: _RequestState,
                   scheduler_output: SchedulerOutput) -> SaveSpec | None:
        """The chunks that become complete in paged memory during this step (chunked prefill included)."""
        num_tokens = request.num_prompt_tokens
        computed_end = request.num_computed_tokens + scheduler_output.num_scheduled_tokens[request.request_id]
        start, end = save_range(num_tokens, min(computed_end, num_tokens), state.saved_end,
                                state.skip_leading_tokens, self.chunk_size)
        if end <= start:
            return None
        state.saved_end = end
        slots = slots_for(scheduler_output.block_tables[request.request_id], start, end, self.block_size)
        return SaveSpec(request.request_id, list(request.prompt_token_ids), request.cache_salt, start, end,
                        state.skip_leading_tokens, slots)

    # ---- worker-side bookkeeping shared by the subclasses ----
    def _begin_step(self, metadata: ChunkedConnectorMetadata) -> None:
        self._step_saves = list(metadata.saves)

    def _fail_load(self, load: InFlightLoad, exc: BaseException) -> None:
        with load.lock:
            load.failed = True
        rid = load.spec.request_id
        self._failed.add(rid)
        self.metrics.on_fallback(rid, self._failure_reason(exc), load.spec.plan.need_to_load)

    def _drop_saves_of_failed_loads(self) -> set[str]:
        """KV computed over a failed load is wrong: do not commit it, store those chunks after the recompute.

        Returns the request ids whose saves were dropped."""
        dropped = set()
        for spec in self._step_saves:
            if spec.request_id in self._failed:
                state = self._requests.get(spec.request_id)
                if state is not None:
                    state.saved_end = min(state.saved_end, spec.start)
                dropped.add(spec.request_id)
        self._step_saves = []
        return dropped

    def get_failed_loads(self) -> set[str]:
        failed, self._failed = self._failed, set()
        return failed

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        return False, None
