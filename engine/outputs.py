"""What the engine hands back: each choice's progress after a step (StepOutput) and engine counters (EngineStats)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log-probability at one position (vLLM's Logprob); rank 1 is the most likely token."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class StepOutput:
    """One choice of a request after a step: the delta of this step, plus everything so far once it finished.

    `token_ids` and `text` (the whole output) are filled on the final output only; while the
    request runs they are empty and the `new_*` fields carry the step's delta. Copying the
    whole output into every step's output would cost O(n) per step, O(n^2) per stream.
    `text` excludes a matched stop string (unless include_stop_str_in_output); while a request
    runs, text that could still turn out to be the start of a stop string is held back from
    `new_text`. With n > 1 each choice reports separately under the same `request_id`, told
    apart by `index`; `finished` is that choice's.
    """

    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[float]
    token_ids: list[int]  # the whole output, on the final output only ([] while running)
    text: str  # the whole output text, on the final output only ("" while running)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    num_cached_tokens: int  # prompt tokens that came from the prefix cache or the KV store
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    # Per new token, its `top_logprobs` most likely (token id, logprob), best first; [] unless asked.
    new_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    index: int = 0  # which of the request's n choices
    # With prompt_logprobs, once the prompt is computed: None for the first prompt token, then
    # {token id: Logprob} holding the prompt token and the most likely tokens at that position.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    error: str | None = None  # with finish_reason "error": what failed this request (and only it)


@dataclass(frozen=True)
class Resume:
    """Where a broken stream stopped: the output tokens the client has, and how many characters of
    their text (the continuation sends only what comes after)."""

    output_token_ids: list[int]
    num_sent_chars: int


@dataclass(frozen=True)
class FirstToken:
    """A request's first output token, sampled by the P/D prefill node that computed its prompt
    (docs/architecture.md, "The first token"): the decode node streams it as its own first token and
    computes from there, so it never recomputes the prompt's last position. Its logprobs ride along
    when the request asked for them."""

    token_id: int
    logprob: float | None = None  # with logprobs
    top_logprobs: list[tuple[int, float]] | None = None  # with top_logprobs or logprob_token_ids


@dataclass
class EngineStats:
    """Counters since start-up (monotonic) plus the current queue and cache state."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_usage: float  # fraction of blocks held by requests
    prefix_cache_queries: int  # prompt tokens looked up in the local prefix cache
    prefix_cache_hits: int  # of those, tokens found
    num_preemptions: int
    num_prompt_tokens_computed: int  # prompt tokens that went through the forward pass
    num_generation_tokens: int  # sampled tokens
    num_requests_added: int
    num_requests_finished: int
    num_failed_loads: int  # external KV loads that failed and were recomputed

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
