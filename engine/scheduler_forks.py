"""Sequences that start from another's KV: the choices of an n > 1 request and the beams of a beam search.

The `Scheduler` half that forks a sequence from its parent's computed tokens (the full blocks
shared, the partial last block copied before the next step) and drops the ones that lost; the
attributes it uses are the scheduler's (engine/scheduler.py).
"""
from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING, Any

from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler_output import ModelRunnerOutput

if TYPE_CHECKING:
    from pdserve.engine.beam_search import BeamSearch
    from pdserve.engine.kv_cache_manager import KVCacheManager

logger = logging.getLogger("pdserve.engine.scheduler")


class SequenceForks:
    config: Any
    kv_cache_manager: KVCacheManager
    requests: dict[str, Request]
    waiting: deque[Request]
    running: list[Request]
    _fork_parents: dict[str, Request]
    _blocks_to_copy: list[tuple[int, int]]
    _beam_searches: dict[str, BeamSearch]
    finished_beam_searches: list[BeamSearch]
    _check_stop: Any
    _free_request: Any

    def _fork(self, parent: Request, runner_output: ModelRunnerOutput) -> list[Request]:
        """Choice 0 of an n > 1 request computed its prompt: start the other choices from it.

        Each shares the prompt's full blocks, gets a copy of the partial last block, and takes the
        token the runner sampled for it from the same logits, so the prompt is computed (or loaded)
        once. A choice that finds no free block or no free sequence slot waits as if preempted,
        and is recomputed later (its prompt then mostly from the prefix cache).
        """
        forks, parent.forks = parent.forks, []
        for fork in forks:
            del self._fork_parents[fork.request_id]
            rid = fork.request_id
            fork.num_cached_tokens = parent.num_cached_tokens
            fork.prompt_logprobs = parent.prompt_logprobs
            token = runner_output.sampled_token_ids[rid]
            fork.append_output_token(token, runner_output.logprobs.get(rid), runner_output.top_logprobs.get(rid))
            if self.check_stop(fork, token):  # done at its first token: needs no blocks at all
                self._free_request(fork)
                continue
            if not self._place_fork(parent, fork):
                logger.info("Reqid: %s, choice %d waits for room: its prompt is recomputed later",
                            fork.request_id, fork.index)
        return forks

    def _place_fork(self, parent: Request, fork: Request) -> bool:
        """`fork` runs on from `parent`'s computed tokens: the full blocks shared, the partial one copied
        before the next step. False: no free block or sequence slot, it waits and is recomputed later."""
        copy = self.kv_cache_manager.fork(parent, fork) if len(self.running) < self.config.max_num_seqs else False
        if copy is False:
            fork.status = RequestStatus.PREEMPTED
            self.waiting.appendleft(fork)
            return False
        if copy is not None:
            self._blocks_to_copy.append(copy)
        fork.num_computed_tokens = parent.num_computed_tokens
        fork.status = RequestStatus.RUNNING
        self.running.append(fork)
        return True

    # beam search: engine/beam_search.py ranks the beams, these move their sequences
    def _offer_beam(self, request: Request, candidates: list[tuple[int, float]]) -> None:
        search = request.beam
        if search.offer(request, candidates):
            search.advance(self)
            if search.done:
                search.drop_all(self)
                del self._beam_searches[search.request_id]
                self.finished_beam_searches.append(search)

    def fork_sequence(self, parent: Request, request_id: str, token: int) -> Request:
        """A new beam: `parent`'s tokens and `token`, from the parent's KV (`_place_fork`)."""
        child = Request(request_id, parent.prompt_token_ids, parent.sampling_params, parent.eos_token_id,
                        parent.cache_salt, parent.arrival_time, parent_id=parent.parent_id)
        child.beam, child.num_cached_tokens = parent.beam, parent.num_cached_tokens
        for t in [*parent.output_token_ids, token]:
            child.append_output_token(t)
        self.requests[request_id] = child
        self._place_fork(parent, child)
        return child

    def drop_sequence(self, request: Request) -> None:
        """A beam that lost (or a search that ended): its blocks freed, its slot given up."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED_ABORTED
        self._free_request(request)
