"""The scheduler (vLLM v1 model): one token budget per step, no prefill/decode phases.

Each step every scheduled request's `num_computed_tokens` catches up towards its
`num_tokens`: running requests first (mostly 1-token decodes), then waiting ones (whose
prompts are chunked to fit the budget). When the block pool runs dry, the newest running
request is preempted: its blocks are freed and it is recomputed later, from the front of
the waiting queue. KV-connector hooks are named `# connector hook:` below. Sequences that start
from another's KV (the choices of n > 1, the beams of a beam search) are forked and dropped by the
`SequenceForks` it holds (engine/scheduler_forks.py).

Store I/O never runs inside a step (docs/architecture.md, "Failure behaviour"): a waiting
request whose store lookup is still in flight is skipped; a request whose external KV loads
in the background is parked in WAITING_FOR_REMOTE_KVS (blocks allocated) until the load ends;
a finished request whose saves are still in flight keeps its blocks, and its final output
waits for the commit at most `save_timeout_s`. Everyone else keeps stepping meanwhile.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import TYPE_CHECKING

from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler_forks import SequenceForks
from pdserve.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from pdserve.engine.beam_search import BeamSearch
    from pdserve.engine.kv_connector import KVConnectorBase

logger = logging.getLogger(__name__)

_SKIP = -1  # _admit: not schedulable this step (lookup in flight, or parked while its KV loads)


class Scheduler:
    def __init__(self, config: EngineConfig, kv_cache_manager: KVCacheManager,
                 connector: KVConnectorBase | None = None, max_model_len: int | None = None) -> None:
        self.config = config.scheduler
        self.kv_cache_manager = kv_cache_manager
        self.connector = connector
        self.kv_load_mode = config.kv_transfer.kv_load_mode
        self.save_timeout_s = config.kv_transfer.save_timeout_s
        # At most this many LoRA adapters in one step (vLLM's max_loras; 0: LoRA off)
        self.max_loras = config.lora.max_loras if config.lora.enable_lora else 0
        # LLMEngine.max_model_len, the one effective limit (None: none, for model-less tests).
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()  # since the last schedule(), for the runner
        self.sequence_forks = SequenceForks(self, kv_cache_manager, self.config.max_num_seqs)
        self._delayed_free: dict[str, Request] = {}  # finished, blocks held until the connector's save ended
        self._held_outputs: dict[str, float] = {}  # finished, output held until its commit: id -> deadline
        self._loaded: dict[str, bool] = {}  # parked request id -> its background load succeeded
        self._beam_searches: dict[str, BeamSearch] = {}  # use_beam_search: request id -> its running search
        self.finished_beam_searches: list[BeamSearch] = []  # ended since the engine last took them
        self.num_preemptions = 0
        self.num_prompt_tokens_computed = 0
        self.num_failed_loads = 0

    # ---- requests in and out ----
    def add_request(self, request: Request) -> None:
        """Queue `request`; its forks (n > 1) are known (abortable) now, scheduled once it has its prompt's KV."""
        for r in [request, *request.forks]:
            if r.request_id in self.requests:
                raise ValueError(f"request id {r.request_id!r} is already in use")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if request.beam is not None:
            self._beam_searches[request.parent_id] = request.beam
        for fork in request.forks:
            fork.status = RequestStatus.WAITING
            self.requests[fork.request_id] = fork
        self.sequence_forks.add_choices(request)

    def finish_requests(self, request_ids: str | list[str], status: RequestStatus) -> list[Request]:
        """Finish (stop string) or abort requests from outside; unknown ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        done = []
        for request_id in ids:
            if request_id in self._beam_searches:  # every beam of the search, whichever object holds the id
                search = self._beam_searches.pop(request_id)
                search.drop_all(self)
                search.anchor.status = status
                done.append(search.anchor)
                continue
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if self.sequence_forks.withdraw(request):  # never scheduled: nothing to free
                request.status = status
                del self.requests[request_id]
                done.append(request)
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self.free_request(request)
            done.append(request)
        return done

    def has_unfinished_requests(self) -> bool:
        """Also true while finished requests wait for their saves: the engine keeps polling them."""
        return bool(self.waiting or self.running or self._delayed_free)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- one step ----
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[Request] = []
        num_scheduled: dict[str, int] = {}
        preempted: set[str] = set()

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = self._num_tokens_to_schedule(request, request.num_computed_tokens, budget)
            if n == 0:  # a beam whose next token waits for its other beams' offers
                i += 1
                continue
            while self.kv_cache_manager.allocate_slots(request, n) is None:
                victim = self.running.pop()  # newest running request
                self._preempt(victim)
                preempted.add(victim.request_id)
                if victim is request:
                    break
            if request.request_id in preempted:
                break
            scheduled.append(request)
            num_scheduled[request.request_id] = n
            budget -= n
            i += 1

        # A step that had to preempt is short of blocks: admitting anyone would just thrash.
        skipped: list[Request] = []  # waiting on store I/O or a LoRA slot: keep their place, look further
        loras = {r.lora for r in self.running if r.lora is not None} if self.max_loras else set()
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[0]
            if request.lora is not None and request.lora not in loras and len(loras) >= self.max_loras:
                skipped.append(self.waiting.popleft())  # every slot holds another adapter this step
                continue
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                n = self._resume_after_load(request, budget)
            else:
                n = self._admit(request, budget, alone=not scheduled)
            if n is None:
                break
            self.waiting.popleft()
            if n == _SKIP:
                skipped.append(request)
                continue
            self.running.append(request)
            if request.lora is not None:
                loras.add(request.lora)
            request.status = RequestStatus.RUNNING
            scheduled.append(request)
            num_scheduled[request.request_id] = n
            budget -= n
        self.waiting.extendleft(reversed(skipped))

        out = SchedulerOutput(
            scheduled_requests=scheduled,
            num_scheduled_tokens=num_scheduled,
            block_tables={r.request_id: self.kv_cache_manager.get_block_ids(r.request_id) for r in scheduled},
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=preempted,
            blocks_to_copy=self.sequence_forks.take_blocks_to_copy(),
        )
        self.finished_req_ids = set()
        if self.connector is not None:  # connector hook: the step's loads and saves
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        return out

    def _num_tokens_to_schedule(self, request: Request, num_computed: int, budget: int) -> int:
        n = request.num_tokens - num_computed
        if request.first_token_given and num_computed < request.num_prompt_tokens:
            n = request.num_prompt_tokens - num_computed
        threshold = self.config.long_prefill_token_threshold
        if threshold:
            n = min(n, threshold)
        return min(n, budget)

    def _admit(self, request: Request, budget: int, alone: bool) -> int | None:
        """Prefix lookup + allocation for a waiting request: its new-token count, None if no room,
        or _SKIP (its store lookup is in flight, or it was parked while its KV loads)."""
        kv = self.kv_cache_manager
        # prompt_logprobs need every prompt position's logits: no prefix-cache hit, no KV load
        full_prompt = request.needs_prompt_logprobs
        computed_blocks, num_local = ([], 0) if full_prompt else kv.get_computed_blocks(request)
        num_external, load_async = 0, False
        if self.connector is not None and not (full_prompt and self.connector.role.loads):
            # connector hook: what the store adds beyond the local hit
            offered, load_async = self.connector.get_num_new_matched_tokens(request, num_local)
            if offered is None:  # the lookup is still in flight: others go first
                return _SKIP
            num_external = max(0, min(offered, request.num_tokens - 1 - num_local))  # last token: computed
        park = num_external > 0 and load_async and not (
            self.kv_load_mode == "layerwise" or (self.kv_load_mode == "auto" and alone))
        n = self._num_tokens_to_schedule(request, num_local + num_external, budget)
        if kv.allocate_slots(request, n, computed_blocks, num_external) is None:
            return None
        if request.status == RequestStatus.WAITING:  # first admission (a recompute is PREEMPTED); a failed
            request.num_cached_tokens = num_local + num_external  # load corrects it (_rewind_failed_load)
        if park:  # the connector reads the status: a background load, not one inside the forward pass
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        if self.connector is not None:  # connector hook: where the external tokens must be written
            self.connector.update_state_after_alloc(request, kv.get_block_ids(request.request_id), num_external)
        kv.record_prefix_lookup(request.num_tokens, num_local)
        request.num_local_computed_tokens = num_local
        request.num_external_computed_tokens = num_external
        if park:
            request.num_computed_tokens = num_local  # the external tokens count once they are loaded
            return _SKIP
        request.num_computed_tokens = num_local + num_external
        return n

    def _resume_after_load(self, request: Request, budget: int) -> int | None:
        """A parked request: _SKIP while its load runs; once it ended, its new-token count (None: no room)."""
        ok = self._loaded.get(request.request_id)
        if ok is None:
            return _SKIP
        if ok:
            loaded = request.num_local_computed_tokens + request.num_external_computed_tokens
        else:
            loaded = request.num_local_computed_tokens
        request.num_computed_tokens = loaded
        n = self._num_tokens_to_schedule(request, loaded, budget)
        if self.kv_cache_manager.allocate_slots(request, n) is None:  # only grows past what admission took
            return None
        del self._loaded[request.request_id]
        if ok:
            self.kv_cache_manager.cache_blocks(request, loaded)
        else:
            self._rewind_failed_load(request)
        return n

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        logger.info("Reqid: %s, preempted (out of KV blocks), %d tokens to recompute, %d blocks free",
                    request.request_id, request.num_tokens, self.kv_cache_manager.num_free_blocks)

    # ---- after the step ----
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[Request]:
        """Advance progress, append sampled tokens, apply stop checks; returns requests with news."""
        updated: list[Request] = []
        for rid in runner_output.finished_recving:  # background loads that ended, either way
            request = self.requests.get(rid)
            if request is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self._loaded[rid] = rid not in runner_output.failed_load_req_ids
        for request in scheduler_output.scheduled_requests:
            if request.is_finished:  # aborted between schedule() and now
                continue
            rid = request.request_id
            if rid in runner_output.failed_load_req_ids:
                self._rewind_failed_load(request)
                continue
            before = request.num_computed_tokens
            request.num_computed_tokens += scheduler_output.num_scheduled_tokens[rid]
            self.num_prompt_tokens_computed += max(0, min(request.num_computed_tokens, request.num_prompt_tokens)
                                                   - before)
            self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
            if rid in runner_output.prompt_logprobs:
                first, entries = runner_output.prompt_logprobs[rid]
                if first == len(request.prompt_logprobs) + 1:
                    request.prompt_logprobs.extend(entries)
            token = runner_output.sampled_token_ids.get(rid)
            if token is None:  # a prefill chunk that did not reach the end of the prompt
                continue
            if request.beam is not None:
                self._offer_beam(request, runner_output.top_logprobs.get(rid, []))
                continue
            forks = self.sequence_forks.fork_choices(request, runner_output) if request.forks else []
            request.append_output_token(token, runner_output.logprobs.get(rid), runner_output.top_logprobs.get(rid))
            held = False
            if self.check_stop(request, token):
                self.running.remove(request)
                if self.free_request(request):  # its final output waits for the commit of its KV
                    self._held_outputs[rid] = time.monotonic() + self.save_timeout_s
                    held = True
            if not held:
                updated.append(request)
            updated.extend(forks)
        updated.extend(self._free_finished_saves(runner_output.finished_sending))
        return updated

    # beam search: engine/beam_search.py ranks the beams, the forks move their sequences
    def _offer_beam(self, request: Request, candidates: list[tuple[int, float]]) -> None:
        search = request.beam
        if search.offer(request, candidates):
            search.advance(self)
            if search.done:
                search.drop_all(self)
                del self._beam_searches[search.request_id]
                self.finished_beam_searches.append(search)

    def fork_sequence(self, parent: Request, request_id: str, token: int) -> Request:
        """A new beam (BeamSearch calls it): `parent`'s tokens and `token`, from the parent's KV."""
        return self.sequence_forks.fork_sequence(parent, request_id, token)

    def drop_sequence(self, request: Request) -> None:
        """A beam that lost, or a search that ended (BeamSearch calls it): its blocks freed, its slot given up."""
        self.sequence_forks.drop_sequence(request)

    def _rewind_failed_load(self, request: Request) -> None:
        """External KV did not arrive: recompute from the local hit (the blocks stay allocated)."""
        self.num_failed_loads += 1
        request.num_computed_tokens = request.num_local_computed_tokens
        request.num_cached_tokens = request.num_local_computed_tokens
        # The connector already logged the fallback line (docs/architecture.md, Log lines) with its reason.
        logger.info("Reqid: %s, rewound to %d locally computed tokens after a failed KV load",
                    request.request_id, request.num_local_computed_tokens)
        request.num_external_computed_tokens = 0

    def check_stop(self, request: Request, token: int) -> bool:
        """Whether `token`, just appended, ends the request (EOS, a stop token, max_tokens, the context
        length); sets its finished status."""
        params = request.sampling_params
        if token == request.eos_token_id and not params.ignore_eos:
            request.status = RequestStatus.FINISHED_STOPPED
        elif token in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = token
        elif (request.num_output_tokens >= params.max_tokens
              or (self.max_model_len is not None and request.num_tokens >= self.max_model_len)):
            request.status = RequestStatus.FINISHED_LENGTH
        return request.is_finished

    def free_request(self, request: Request) -> bool:
        """Finished or aborted: tell the connector, then free the blocks unless it still saves from them.

        Returns True when the blocks are held for a save in flight."""
        self.finished_req_ids.add(request.request_id)
        self.sequence_forks.queue_alone(request)  # choice 0 ended before its prompt was done: the others prefill alone
        self._loaded.pop(request.request_id, None)
        delay = False
        if self.connector is not None:  # connector hook: the request is done
            delay, _ = self.connector.request_finished(
                request, self.kv_cache_manager.get_block_ids(request.request_id))
        if delay:
            self._delayed_free[request.request_id] = request
        else:
            self._release(request)
        return delay

    def _free_finished_saves(self, finished_sending: set[str]) -> list[Request]:
        """Free the blocks of saves that ended; returns finished requests whose held output is now due
        (their commit ended, or save_timeout_s passed: the reply goes, the save may still finish)."""
        due = []
        for request_id in finished_sending:
            request = self._delayed_free.pop(request_id, None)
            if request is not None:
                self._release(request)
                if self._held_outputs.pop(request_id, None) is not None:
                    due.append(request)
        if self._held_outputs:
            now = time.monotonic()
            for request_id, deadline in list(self._held_outputs.items()):
                if now >= deadline:
                    del self._held_outputs[request_id]
                    logger.warning("Reqid: %s, KV commit not done after %.1f s; replying without waiting for it",
                                   request_id, self.save_timeout_s)
                    due.append(self._delayed_free[request_id])
        return due

    def _release(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        if self.requests.get(request.request_id) is request:
            del self.requests[request.request_id]
