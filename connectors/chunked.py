"""The scheduler half and the I/O control flow shared by every chunked connector (store and LMCache).

Both connectors answer the same questions with the arithmetic of docs/architecture.md; they
differ only in how a prompt's present chunk prefix is looked up and how bytes move. This
class owns the per-request bookkeeping (load plan, save progress), the step metadata, and
*when* store I/O runs relative to the scheduler (docs/architecture.md, "Failure behaviour"):

- lookups run in the background; until the answer (or `load_timeout_s`: recompute) the
  scheduler is told None and skips the request;
- a background load (request parked in WAITING_FOR_REMOTE_KVS) is polled by `get_finished`
  each step and ends ok, failed, or at its deadline; a layer-wise load is waited for inside
  the forward pass by the subclass, bounded by the same deadline;
- saves are handed to the background at the end of the step; `get_finished` reports a
  finished request once its saves committed, failed, or passed `save_timeout_s`.

Subclasses implement how: `start_lookup`, `_start_loads`, `wait_for_layer_load`,
`save_kv_layer` and `wait_for_save` (which hands each save to `_track_save`).
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from abc import abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pdserve.connectors.chunk_math import LoadPlan, save_range, slots_for
from pdserve.connectors.kv_metrics import KVTransferMetrics
from pdserve.engine.config import KVRole
from pdserve.engine.kv_connector import KVConnectorBase, KVConnectorMetadata
from pdserve.kvstore.gate import WriteGate

if TYPE_CHECKING:
    from pdserve.engine.request import Request
    from pdserve.engine.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)


def lora_label(request: Request) -> str | None:
    """The adapter a request's KV was computed under, as the KV lines name it (None: the base model)."""
    return request.lora.label if request.lora is not None else None


@dataclass
class LoadSpec:
    """Load tokens plan.write_range of one request; `slots` are their paged-KV slots (new blocks only)."""

    request_id: str
    token_ids: list[int]  # the prompt
    cache_salt: str | None
    plan: LoadPlan
    slots: torch.Tensor
    background: bool = False  # the request waits parked across steps; not waited for in the forward pass
    lora_fingerprint: str | None = None  # its LoRA adapter's: part of every chunk key (common/hashing.py)
    lora_label: str | None = None  # how the KV lines name that adapter


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
    lora_fingerprint: str | None = None
    lora_label: str | None = None


@dataclass
class ChunkedConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class InFlightLoad:
    """One request's load. `failed` is set once, under `lock`, and after that no background copy may
    write into the request's blocks (the engine recomputes them, or frees them): a data path that
    copies under `lock` must have finished its copies before it releases it; one whose store reads
    land straight in the blocks writes only inside `gate`, which is closed right after `failed` is
    set (kvstore.gate: close() waits for the bounded copies inside and admits none after)."""

    spec: LoadSpec
    lock: threading.Lock = field(default_factory=threading.Lock)
    gate: WriteGate = field(default_factory=WriteGate)
    num_bytes: int = 0
    started: float = field(default_factory=time.perf_counter)
    finished: float = 0.0  # when the last copy into paged memory ended
    failed: bool = False
    deadline: float = 0.0  # time.monotonic() after which the load counts as timed out
    futures: dict[int, concurrent.futures.Future] = field(default_factory=dict)  # each yields bytes read

    @property
    def io_seconds(self) -> float:
        """From the start of the load to its last copy (reads overlap compute, so this is not added latency)."""
        return max(0.0, self.finished - self.started)


@dataclass
class PendingSave:
    """One request's chunks of one step on their way to the store. The subclass resolves `done` with
    (chunks committed, bytes, I/O seconds) or an exception; once `abandoned` (past its deadline) it
    must not commit any more."""

    spec: SaveSpec
    deadline: float
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    abandoned: bool = False


@dataclass
class _RequestState:
    lookup: concurrent.futures.Future | None = None  # the store lookup in flight
    lookup_deadline: float = 0.0
    hit: int | None = None  # H once the lookup answered (until the request is admitted)
    plan: LoadPlan | None = None
    pending_load: LoadSpec | None = None
    skip_leading_tokens: int = 0  # chunk-aligned prefix already in the store: never written again
    saved_end: int = 0  # prompt tokens stored (or handed to the worker) so far


class ChunkedConnector(KVConnectorBase):
    """Scheduler-side bookkeeping over a store of prompt chunks of `chunk_size` tokens."""

    def __init__(self, role: KVRole, chunk_size: int, block_size: int, load_timeout_s: float = 10.0,
                 save_timeout_s: float = 10.0, metrics: KVTransferMetrics | None = None) -> None:
        super().__init__(role)
        self.chunk_size = chunk_size
        self.block_size = block_size
        self.load_timeout_s = load_timeout_s
        self.save_timeout_s = save_timeout_s
        self.metrics = metrics or KVTransferMetrics(role.value)
        self._requests: dict[str, _RequestState] = {}
        self._failed: set[str] = set()  # loads that failed since get_failed_loads() was last asked
        self._step_saves: list[SaveSpec] = []
        self._loads: list[InFlightLoad] = []  # this step's layer-wise loads
        self._background_loads: dict[str, InFlightLoad] = {}
        self._pending_saves: dict[str, list[PendingSave]] = {}
        self._finishing: set[str] = set()  # finished requests whose blocks wait for their saves

    # ---- subclass hooks ----
    @abstractmethod
    def start_lookup(self, request: Request) -> concurrent.futures.Future:
        """Start finding H (prompt tokens covered by the longest run of present chunks) in the background
        (the scheduler's lookups, and a node's routing hints)."""

    @abstractmethod
    def _start_loads(self, specs: list[LoadSpec]) -> list[InFlightLoad]:
        """Start the reads of one step's loads in the background (their `futures`), one InFlightLoad each."""

    def _failure_reason(self, exc: BaseException) -> str:
        """Short '<kind>: <detail>' text for the fallback line; the kind becomes the metric label."""
        if isinstance(exc, concurrent.futures.TimeoutError):
            return f"timeout: no answer within {self.load_timeout_s:g}s"
        return f"error: {type(exc).__name__}: {exc}"

    def lookup_hit(self, request: Request) -> int:
        """H, waiting for the store (for routing hints; raises on store failure or after load_timeout_s)."""
        return self.start_lookup(request).result(timeout=self.load_timeout_s)

    # ---- scheduler side ----
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self._requests.setdefault(request.request_id, _RequestState())
        if state.hit is None:
            hit = self._lookup_answer(request, state, num_computed_tokens)
            if hit is None:
                return None, False
            state.hit = hit
            if self.role.saves:
                state.skip_leading_tokens = hit
        plan = LoadPlan(request.num_prompt_tokens, num_computed_tokens, state.hit, self.chunk_size,
                        request.num_output_tokens)
        if not self.role.loads:
            state.plan = plan
            return 0, False
        if plan != state.plan:  # a request retried for lack of blocks is logged once, not every step
            state.plan = plan
            self.metrics.on_lookup(request.request_id, plan, lora_label(request))
        return plan.need_to_load, True

    def _lookup_answer(self, request: Request, state: _RequestState, num_computed_tokens: int) -> int | None:
        """H once the background lookup answered; 0 after a failure or its deadline; None while in flight."""
        if state.lookup is None:
            state.lookup = self.start_lookup(request)
            state.lookup_deadline = time.monotonic() + self.load_timeout_s
        future = state.lookup
        if not future.done():
            if time.monotonic() < state.lookup_deadline:
                return None
            future.cancel()
            error: BaseException | None = concurrent.futures.TimeoutError()
        else:
            error = future.exception()
        state.lookup = None
        if error is None:
            return future.result()
        # any lookup failure means "recompute" (or "save every chunk"), never a failed request
        if self.role.loads:
            self.metrics.on_fallback(request.request_id, self._failure_reason(error),
                                     max(0, request.num_prompt_tokens - 1 - num_computed_tokens))
        else:
            logger.warning("Reqid: %s, KV lookup failed (%s); saving every chunk", request.request_id,
                           self._failure_reason(error))
        return 0

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is None:
            return
        state.hit = None  # admitted: a later re-admission (after a preemption) asks the store again
        if state.plan is None or num_external_tokens <= 0:
            return
        plan = state.plan
        if num_external_tokens != plan.need_to_load:
            raise ValueError(f"request {request.request_id}: {num_external_tokens} external tokens allocated, "
                             f"the connector offered {plan.need_to_load}")
        start, end = plan.write_range
        state.pending_load = LoadSpec(request.request_id, list(request.prompt_token_ids), request.cache_salt,
                                      plan, slots_for(block_ids, start, end, self.block_size),
                                      background=request.waiting_for_remote_kvs,
                                      lora_fingerprint=request.lora_fingerprint, lora_label=lora_label(request))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ChunkedConnectorMetadata:
        meta = ChunkedConnectorMetadata()
        for state in self._requests.values():  # this step's admissions: scheduled, or parked while they load
            if state.pending_load is not None:
                meta.loads.append(state.pending_load)
                state.pending_load = None
        if self.role.saves:
            for request in scheduler_output.scheduled_requests:
                state = self._requests.get(request.request_id)
                spec = None if state is None else self._save_spec(request, state, scheduler_output)
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
                        state.skip_leading_tokens, slots, request.lora_fingerprint, lora_label(request))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Cancels a background load (its blocks are about to be freed); delays the free while saves run."""
        rid = request.request_id
        state = self._requests.pop(rid, None)
        if state is not None and state.lookup is not None:
            state.lookup.cancel()
        load = self._background_loads.pop(rid, None)
        if load is not None:
            self._cancel_load(load)
        if self._pending_saves.get(rid):
            self._finishing.add(rid)
            return True, None
        return False, None

    # ---- worker side: the control flow shared by the subclasses ----
    def start_load_kv(self, metadata: ChunkedConnectorMetadata) -> None:
        self._step_saves = list(metadata.saves)
        self._loads = []
        if not metadata.loads:
            return
        deadline = time.monotonic() + self.load_timeout_s
        for load in self._start_loads(metadata.loads):
            load.deadline = deadline
            if load.spec.background:
                self._background_loads[load.spec.request_id] = load
            else:
                self._loads.append(load)

    def _cancel_load(self, load: InFlightLoad) -> None:
        """No more writes into the load's blocks from now on; queued reads are dropped."""
        with load.lock:
            load.failed = True
        load.gate.close()  # waits for reads landing in the blocks right now (bounded copies, no I/O wait)
        for future in load.futures.values():
            future.cancel()

    def _fail_load(self, load: InFlightLoad, exc: BaseException) -> None:
        self._cancel_load(load)
        rid = load.spec.request_id
        self._failed.add(rid)
        self.metrics.on_fallback(rid, self._failure_reason(exc), load.spec.plan.need_to_load)

    def _settle_load(self, load: InFlightLoad) -> bool:
        """For a load whose reads are all done, or one failed: True on success (logged), else recorded
        as failed (a store error or a bad object: the request recomputes)."""
        for future in load.futures.values():
            if future.done() and (future.cancelled() or future.exception() is not None):
                self._fail_load(load, future.exception() if not future.cancelled() else
                                concurrent.futures.CancelledError())
                return False
        load.num_bytes = sum(future.result() or 0 for future in load.futures.values())
        self.metrics.on_load(load.spec.request_id, load.spec.plan, load.num_bytes, load.io_seconds,
                             self._load_codec(load), load.spec.lora_label)
        return True

    def _load_codec(self, load: InFlightLoad) -> str | None:
        """The codec(s) a finished load's bytes were stored with, for its log line (None: not known)."""
        return None

    def _poll_background_loads(self) -> set[str]:
        """Background loads that ended since the last poll: done, failed, or past their deadline."""
        ended = set()
        now = time.monotonic()
        for rid, load in list(self._background_loads.items()):
            done = [f for f in load.futures.values() if f.done()]
            if len(done) == len(load.futures) or any(f.cancelled() or f.exception() is not None for f in done):
                self._settle_load(load)  # all read, or one read failed: no need to wait for the rest
            elif now >= load.deadline:
                self._fail_load(load, concurrent.futures.TimeoutError())
            else:
                continue
            del self._background_loads[rid]
            ended.add(rid)
        return ended

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

    def _track_save(self, spec: SaveSpec) -> PendingSave:
        """Register one request's save of this step; the subclass resolves its `done`."""
        pending = PendingSave(spec, time.monotonic() + self.save_timeout_s)
        self._pending_saves.setdefault(spec.request_id, []).append(pending)
        return pending

    def _poll_saves(self) -> None:
        """Log the saves that committed or failed; give up on those past their deadline."""
        now = time.monotonic()
        for rid, saves in list(self._pending_saves.items()):
            left = []
            for save in saves:
                spec = save.spec
                if save.done.done():
                    error = save.done.exception()
                    if error is not None:  # a save failure never fails the request
                        self.metrics.on_save_failure(rid, self._failure_reason(error))
                    else:
                        num_chunks, num_bytes, seconds = save.done.result()
                        self.metrics.on_save(rid, spec.start, spec.end, len(spec.token_ids),
                                             spec.skip_leading_tokens, num_chunks, num_bytes, seconds,
                                             spec.lora_label)
                elif now >= save.deadline:
                    save.abandoned = True
                    self.metrics.on_save_failure(rid, f"timeout: not committed within {self.save_timeout_s:g}s")
                else:
                    left.append(save)
            if left:
                self._pending_saves[rid] = left
            else:
                del self._pending_saves[rid]

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        recving = self._poll_background_loads()
        self._poll_saves()
        sending = {rid for rid in self._finishing if rid not in self._pending_saves}
        self._finishing -= sending
        return sending, recving

    def get_failed_loads(self) -> set[str]:
        failed, self._failed = self._failed, set()
        return failed

    def failed_load_ids(self) -> set[str]:
        """The loads that failed since get_failed_loads() was last asked, without taking them (a parallel
        engine's ranks share theirs before the step's saves: engine/parallel/kv_ranks.py)."""
        return set(self._failed)

    def loads_failed_elsewhere(self, request_ids: set[str]) -> None:
        """Another rank's load of these requests failed in this step: what this rank computed over it is
        wrong too, so its saves of them are dropped (and redone after the recompute) as for its own failure."""
        self._failed |= request_ids
