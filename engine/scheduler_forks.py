"""Sequences that start from another's KV: the choices of an n > 1 request and the beams of a beam search.

`SequenceForks` forks a sequence from its parent's computed tokens (the full blocks shared, the partial
last block copied before the next step) and drops the ones that lost. The scheduler (engine/scheduler.py)
holds one; it keeps the choices of an n > 1 request that have not forked yet and the block copies the
next step owes, and moves sequences through the scheduler's queues (`SequenceQueues`).
"""
from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING, Protocol

from pdserve.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from pdserve.engine.kv_cache_manager import KVCacheManager
    from pdserve.engine.scheduler_output import ModelRunnerOutput

logger = logging.getLogger("pdserve.engine.scheduler")


class SequenceQueues(Protocol):
    """The scheduler as forks move sequences through it: its request table, its queues, and the two rules
    that end a sequence (a fork may stop at its first token; a dropped beam frees its blocks)."""

    requests: dict[str, Request]
    waiting: deque[Request]
    running: list[Request]

    def check_stop(self, request: Request, token: int) -> bool: ...

    def free_request(self, request: Request) -> bool: ...


class SequenceForks:
    def __init__(self, queues: SequenceQueues, kv_cache_manager: KVCacheManager, max_num_seqs: int) -> None:
        self.queues = queues
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.unforked: dict[str, Request] = {}  # n > 1: choice id -> choice 0, until it forks
        self.blocks_to_copy: list[tuple[int, int]] = []  # forks' partial prompt blocks, for the next step

    # ---- the choices of an n > 1 request before they fork ----
    def add_choices(self, request: Request) -> None:
        """`request` is choice 0: its other choices wait, known (abortable), until its prompt is computed."""
        for fork in request.forks:
            self.unforked[fork.request_id] = request

    def withdraw(self, choice: Request) -> bool:
        """An aborted choice that has not forked yet: off its choice 0's list (it holds nothing to free)."""
        parent = self.unforked.pop(choice.request_id, None)
        if parent is None:
            return False
        parent.forks.remove(choice)
        return True

    def queue_alone(self, parent: Request) -> None:
        """Choice 0 ended before its prompt was done: the other choices prefill alone."""
        for fork in parent.forks:
            del self.unforked[fork.request_id]
            self.queues.waiting.append(fork)
        parent.forks = []

    def take_blocks_to_copy(self) -> list[tuple[int, int]]:
        """The partial blocks the next step must copy before it runs (the forks placed since the last step)."""
        copies, self.blocks_to_copy = self.blocks_to_copy, []
        return copies

    # ---- forking ----
    def fork_choices(self, parent: Request, runner_output: ModelRunnerOutput) -> list[Request]:
        """Choice 0 of an n > 1 request computed its prompt: start the other choices from it.

        Each shares the prompt's full blocks, gets a copy of the partial last block, and takes the
        token the runner sampled for it from the same logits, so the prompt is computed (or loaded)
        once. A choice that finds no free block or no free sequence slot waits as if preempted,
        and is recomputed later (its prompt then mostly from the prefix cache).
        """
        forks, parent.forks = parent.forks, []
        for fork in forks:
            del self.unforked[fork.request_id]
            rid = fork.request_id
            fork.num_cached_tokens = parent.num_cached_tokens
            fork.prompt_logprobs = parent.prompt_logprobs
            token = runner_output.sampled_token_ids[rid]
            fork.append_output_token(token, runner_output.logprobs.get(rid), runner_output.top_logprobs.get(rid))
            if self.queues.check_stop(fork, token):  # done at its first token: needs no blocks at all
                self.queues.free_request(fork)
                continue
            if not self._place_fork(parent, fork):
                logger.info("Reqid: %s, choice %d waits for room: its prompt is recomputed later",
                            fork.request_id, fork.index)
        return forks

    def _place_fork(self, parent: Request, fork: Request) -> bool:
        """`fork` runs on from `parent`'s computed tokens: the full blocks shared, the partial one copied
        before the next step. False: no free block or sequence slot, it waits and is recomputed later."""
        queues = self.queues
        copy = self.kv_cache_manager.fork(parent, fork) if len(queues.running) < self.max_num_seqs else False
        if copy is False:
            fork.status = RequestStatus.PREEMPTED
            queues.waiting.appendleft(fork)
            return False
        if copy is not None:
            self.blocks_to_copy.append(copy)
        fork.num_computed_tokens = parent.num_computed_tokens
        fork.status = RequestStatus.RUNNING
        queues.running.append(fork)
        return True

    # beam search: engine/beam_search.py ranks the beams, these move their sequences
    def fork_sequence(self, parent: Request, request_id: str, token: int) -> Request:
        """A new beam: `parent`'s tokens and `token`, from the parent's KV (`_place_fork`)."""
        child = Request(request_id, parent.prompt_token_ids, parent.sampling_params, parent.eos_token_id,
                        parent.cache_salt, parent.arrival_time, parent_id=parent.parent_id, lora=parent.lora)
        child.beam, child.num_cached_tokens = parent.beam, parent.num_cached_tokens
        for t in [*parent.output_token_ids, token]:
            child.append_output_token(t)
        self.queues.requests[request_id] = child
        self._place_fork(parent, child)
        return child

    def drop_sequence(self, request: Request) -> None:
        """A beam that lost (or a search that ended): its blocks freed, its slot given up."""
        queues = self.queues
        if request in queues.running:
            queues.running.remove(request)
        elif request in queues.waiting:
            queues.waiting.remove(request)
        request.status = RequestStatus.FINISHED_ABORTED
        queues.free_request(request)
