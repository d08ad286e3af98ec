"""Sampling parameters of one request, validated at construction so bad values fail early."""
from __future__ import annotations

from dataclasses import dataclass, field

MAX_TOP_LOGPROBS = 20  # OpenAI's limit


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop (names follow vLLM's SamplingParams)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False  # report the sampled token's logprob
    top_logprobs: int = 0  # also report this many most likely tokens per position (implies logprobs)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= float(self.temperature) <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be a list of non-negative integers")
        if not isinstance(self.top_logprobs, int) or isinstance(self.top_logprobs, bool) or \
                not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        self.logprobs = bool(self.logprobs or self.top_logprobs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
