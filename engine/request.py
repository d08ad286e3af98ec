"""One request's state as the scheduler and model runner see it (vLLM v1's Request)."""
from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.beam_search import BeamSearch
    from pdserve.engine.lora.adapter import LoRAAdapter
    from pdserve.engine.structured_output import RequestGrammar

logger = logging.getLogger(__name__)


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    # Admitted with blocks allocated, its external KV still loading in the background: the
    # scheduler skips it (everyone else keeps stepping) until the load finishes or fails.
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # this request alone failed (an unexpected error in its own handling)

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Request:
    """Token ids plus progress: `num_computed_tokens` catches up towards `num_tokens` each step."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)  # the one arrival clock (TTFT, e2e latency)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # with top_logprobs > 0
    num_computed_tokens: int = 0
    # Prompt tokens that did not need computing on first admission (local prefix cache + external KV);
    # 0 until then. Set once: a recompute after preemption (or a fork's) does not change it.
    num_cached_tokens: int = 0
    # Tokens found in the local prefix cache at the last admission (the connector's N).
    num_local_computed_tokens: int = 0
    # Tokens the connector promised to load at the last admission (the connector's need_to_load).
    num_external_computed_tokens: int = 0
    # Digests of this request's full blocks, in order (filled by the block manager).
    block_hashes: list[bytes] = field(default_factory=list)
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    # n > 1: the client's request id and this sequence's choice index (the request id otherwise, 0).
    parent_id: str | None = None
    index: int = 0
    # n > 1, on choice 0 until its prompt is computed: the other choices, which then fork from it
    # (share its prompt blocks, take their first token from the same logits) instead of prefilling.
    forks: list[Request] = field(default_factory=list)
    grammar: RequestGrammar | None = None  # structured outputs: the allowed next tokens
    # With prompt_logprobs: for prompt tokens 1..T-1, (logprob, rank, top (token id, logprob) list).
    prompt_logprobs: list[tuple[float, int, list[tuple[int, float]]]] = field(default_factory=list)
    error: str | None = None  # why it ended with FINISHED_ERROR
    beam: BeamSearch | None = None  # use_beam_search: the search this sequence is a beam of
    # Its first output token came with it (a P/D prefill node sampled it, engine/outputs.FirstToken):
    # a prompt it must compute after all (a store miss, a preemption) is computed up to its end, and
    # that token's row afterwards as a decode row, as monolithic serving computes them.
    first_token_given: bool = False
    # The LoRA adapter it runs under (None: the base model); its fingerprint names its KV apart.
    lora: LoRAAdapter | None = None

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        if self.parent_id is None:
            self.parent_id = self.request_id

    @property
    def lora_fingerprint(self) -> str | None:
        """What its KV's hash chains start from besides the model and the cache salt (common/hashing.py)."""
        return self.lora.fingerprint if self.lora is not None else None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def waiting_for_remote_kvs(self) -> bool:
        """Parked while its external KV loads in the background (what a connector asks; see scheduler)."""
        return self.status == RequestStatus.WAITING_FOR_REMOTE_KVS

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Every prompt position's logits are needed: no prefix-cache hit or KV load can stand in."""
        return self.sampling_params.prompt_logprobs is not None

    def append_output_token(self, token_id: int, logprob: float | None = None,
                            top_logprobs: list[tuple[int, float]] | None = None) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.grammar is not None and not self.grammar.accept(token_id):
            # Only possible when every allowed token was also forbidden (e.g. min_tokens vs a complete grammar).
            logger.error("Reqid: %s, token %d is outside its grammar; the output is no longer constrained",
                         self.request_id, token_id)
            self.grammar = None
        if logprob is not None:
            self.output_logprobs.append(logprob)
        if top_logprobs is not None:
            self.output_top_logprobs.append(top_logprobs)
