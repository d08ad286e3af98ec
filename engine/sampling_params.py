"""Sampling parameters of one request, validated at construction so bad values fail early.

Names and meanings follow vLLM's SamplingParams (and its StructuredOutputsParams), so that a
vLLM user's offline script and request bodies carry over unchanged.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

MAX_TOP_LOGPROBS = 20  # vLLM's default --max-logprobs (OpenAI's limit too)
MAX_N = 128  # choices per prompt; pdserve's cap (vLLM's VLLM_MAX_N_SEQUENCES defaults to 16384)
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # a seed is a 64-bit signed integer (the gRPC field is int64)
MAX_LOGIT_BIAS = 100.0  # OpenAI's limit on each logit_bias value
# The largest max_tokens, min_tokens or top_k: a 32-bit count, what the gRPC wire carries (int32/uint32),
# so a count has one bound whether it arrives offline, over HTTP or from pd-proxy.
MAX_COUNT = 2**31 - 1


class SamplingParamsError(ValueError):
    """A sampling value outside its bound; `param` names the field, so the HTTP layer's 400 can name it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Bound:
    """The values a numeric field takes: [lo, hi] (lo excluded when lo_open; None: unbounded)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    integer: bool = False

    def __str__(self) -> str:
        if self.hi is None:
            return f"{'>' if self.lo_open else '>='} {self.lo}"
        return f"in {'(' if self.lo_open else '['}{self.lo}, {self.hi}]"

    def check(self, name: str, value: Any) -> None:
        """SamplingParamsError naming `name` unless `value` has the field's type and lies in the bound."""
        if self.integer and not _is_int(value):
            raise SamplingParamsError(name, f"{name} must be an integer, got {value!r}")
        if not self.integer and not _is_number(value):
            raise SamplingParamsError(name, f"{name} must be a finite number, got {value!r}")
        if ((self.lo is not None and (value < self.lo or (self.lo_open and value == self.lo)))
                or (self.hi is not None and value > self.hi)):
            raise SamplingParamsError(name, f"{name} must be {self}, got {value}")


# The one table of numeric bounds: vLLM's (its SamplingParams._verify_args), floats written as floats as
# the OpenAI error messages quote them. The HTTP layer reads a field's JSON type and leaves its value to
# these; docs/vllm-compat.md lists them (tests/serving/test_protocol.py keeps the two equal).
BOUNDS: dict[str, Bound] = {
    "n": Bound(1, MAX_N, integer=True),
    "max_tokens": Bound(1, MAX_COUNT, integer=True),
    "min_tokens": Bound(0, MAX_COUNT, integer=True),  # and at most max_tokens
    "temperature": Bound(0.0, 2.0),  # vLLM refuses above 2 since vllm-project/vllm#44965, as OpenAI does
    "top_p": Bound(0.0, 1.0, lo_open=True),
    "top_k": Bound(-1, MAX_COUNT, integer=True),  # 0 or -1: disabled
    "min_p": Bound(0.0, 1.0),
    "seed": Bound(SEED_MIN, SEED_MAX, integer=True),  # and seed + n - 1 too (choice i uses seed + i)
    "presence_penalty": Bound(-2.0, 2.0),
    "frequency_penalty": Bound(-2.0, 2.0),
    "repetition_penalty": Bound(0.0, lo_open=True),  # any finite number > 0 (vLLM); 1 is off
    "top_logprobs": Bound(0, MAX_TOP_LOGPROBS, integer=True),
    "prompt_logprobs": Bound(0, MAX_TOP_LOGPROBS, integer=True),
    "length_penalty": Bound(-1e6, 1e6),  # vLLM leaves it unbounded; the bound pdserve's HTTP layer had
}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def parse_logit_bias(bias: Any) -> dict[int, float] | None:
    """OpenAI's logit_bias ({"token id": bias}, keys may be JSON strings) as {int: float};
    SamplingParamsError (a ValueError) if bad."""
    if not bias:
        return None
    if not isinstance(bias, dict):
        raise SamplingParamsError("logit_bias", "logit_bias must map token ids to numbers")
    out: dict[int, float] = {}
    for token, value in bias.items():
        try:
            if isinstance(token, (bool, float)):
                raise ValueError
            tid = int(token)  # JSON object keys arrive as strings
        except (TypeError, ValueError):
            raise SamplingParamsError("logit_bias", f"logit_bias keys must be token ids, got {token!r}") from None
        if tid < 0:
            raise SamplingParamsError("logit_bias", f"logit_bias keys must be non-negative token ids, got {token!r}")
        if not _is_number(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise SamplingParamsError("logit_bias", f"logit_bias values must be numbers in [-100, 100], "
                                                    f"got {value!r} for token {tid}")
        out[tid] = float(value)
    return out


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain the output to a grammar (vLLM's StructuredOutputsParams); exactly one kind is set.

    `json` is a JSON schema (dict or JSON text), `regex` a regular expression, `choice` a list of
    allowed strings, `grammar` an EBNF grammar (xgrammar's dialect, root rule `root`), and
    `json_object=True` any JSON object. `disable_any_whitespace` makes JSON compact.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        kinds = [k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, k)]
        if len(kinds) != 1:
            raise ValueError("structured outputs need exactly one of json, regex, choice, grammar or json_object"
                             + (f"; got {', '.join(kinds)}" if kinds else ""))
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError("structured outputs json must be a JSON schema (an object or its JSON text)")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError("structured outputs regex must be a string")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ValueError("structured outputs grammar must be a string")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured outputs choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", list(self.choice))
        if self.json_object not in (None, True, False):
            raise ValueError("structured outputs json_object must be a boolean")

    @property
    def kind(self) -> str:
        return next(k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, k))

    @property
    def key(self) -> tuple[str, str, bool]:
        """A hashable identity (the compiled-grammar cache key); JSON schemas are canonicalised."""
        spec: Any = getattr(self, self.kind)
        if self.kind == "json" and isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except ValueError:
                pass  # invalid: compiling it reports why
        if self.kind == "json" and isinstance(spec, dict):
            spec = json.dumps(spec, sort_keys=True, separators=(",", ":"))
        elif self.kind == "choice":
            spec = json.dumps(spec)
        elif self.kind == "json_object":
            spec = ""
        return self.kind, spec, self.disable_any_whitespace


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop (names and semantics follow vLLM's SamplingParams)."""

    n: int = 1  # output sequences per prompt; they share the prompt's KV (computed once)
    max_tokens: int = 16
    min_tokens: int = 0  # EOS and stop_token_ids are masked (and stop strings ignored) before this many
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0  # drop tokens below min_p x the most likely token's probability
    seed: int | None = None  # choice i of n > 1 uses seed + i
    presence_penalty: float = 0.0  # subtracted once from the logit of every token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of prompt+output tokens
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # Report the sampled token's logprob. An int k (not a bool) means what it means in vLLM: the
    # sampled token's plus the k most likely tokens' (top_logprobs = k).
    logprobs: bool | int | None = False
    top_logprobs: int = 0  # also report this many most likely tokens per position (implies logprobs)
    logprob_token_ids: list[int] | None = None  # report these tokens' logprobs instead of the most likely ones
    prompt_logprobs: int | None = None  # per prompt token: its logprob, rank, and this many top tokens
    structured_outputs: StructuredOutputsParams | None = None
    bad_words: list[str] = field(default_factory=list)  # words the output may not contain (vLLM's rule)
    allowed_token_ids: list[int] | None = None  # only these tokens may be sampled
    # bad_words as token sequences: derived by the engine with its tokenizer (engine/token_masks.py)
    bad_words_token_ids: list[list[int]] | None = None
    # Beam search of width n (engine/beam_search.py, HF's ranking): the n best beams are the n choices.
    use_beam_search: bool = False
    length_penalty: float = 1.0  # a finished beam's score: accumulated logprob / its length ** length_penalty

    def __post_init__(self) -> None:
        """Every value against vLLM's bounds (BOUNDS): the one place a request's values are checked,
        offline and over HTTP alike (the HTTP layer turns the SamplingParamsError into a 400)."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._check_bounds("n", "max_tokens", "min_tokens")
        if self.min_tokens > self.max_tokens:
            raise SamplingParamsError("min_tokens", f"min_tokens ({self.min_tokens}) must not exceed max_tokens "
                                                    f"({self.max_tokens})")
        self._check_bounds("temperature", "top_p", "top_k", "min_p")
        if self.seed is not None:
            # choice i of n uses seed + i: every one of them must be a 64-bit signed integer
            Bound(SEED_MIN, SEED_MAX - self.n + 1, integer=True).check("seed", self.seed)
        self._check_bounds("presence_penalty", "frequency_penalty", "repetition_penalty")
        self.logit_bias = parse_logit_bias(self.logit_bias)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise SamplingParamsError("stop", "stop must be a non-empty string or a list of non-empty strings")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise SamplingParamsError("stop_token_ids", "stop_token_ids must be a list of non-negative token ids")
        if _is_int(self.logprobs):  # vLLM's int: the sampled token's plus this many most likely tokens'
            BOUNDS["top_logprobs"].check("logprobs", self.logprobs)
            self.top_logprobs, self.logprobs = self.top_logprobs or self.logprobs, True
        BOUNDS["top_logprobs"].check("top_logprobs", self.top_logprobs)
        if self.prompt_logprobs is not None:
            BOUNDS["prompt_logprobs"].check("prompt_logprobs", self.prompt_logprobs)
        self.bad_words = list(self.bad_words or [])
        if any(not isinstance(w, str) or not w for w in self.bad_words):
            raise SamplingParamsError("bad_words", "bad_words must be a list of non-empty strings")
        for name in ("allowed_token_ids", "logprob_token_ids"):
            ids = getattr(self, name)
            if ids is not None and (not ids or any(not _is_int(t) or t < 0 for t in ids)):
                raise SamplingParamsError(name, f"{name} must be a non-empty list of non-negative token ids")
        if self.logprob_token_ids and not self.logprobs:
            raise SamplingParamsError("logprob_token_ids", "logprob_token_ids requires logprobs")
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise SamplingParamsError("structured_outputs", "structured_outputs must be a StructuredOutputsParams")
        self.logprobs = bool(self.logprobs or self.top_logprobs)
        self._check_bounds("length_penalty")
        if self.use_beam_search:
            self._check_beam_search()

    def _check_bounds(self, *names: str) -> None:
        """Each field against BOUNDS, as given (an error quotes the client's 2, not 2.0); a number field
        is then stored as a float, so the sampler sees one type."""
        for name in names:
            bound, value = BOUNDS[name], getattr(self, name)
            bound.check(name, value)
            if not bound.integer:
                setattr(self, name, float(value))

    def _check_beam_search(self) -> None:
        """Beam search ranks beams by their raw logprobs alone: what would reshape the logits or the
        stopping rule, or report per-token logprobs, is refused rather than silently ignored."""
        unsupported = {"logprob_token_ids": self.logprob_token_ids, "logprobs": self.logprobs,
                       "prompt_logprobs": self.prompt_logprobs is not None, "stop": self.stop,
                       "stop_token_ids": self.stop_token_ids, "min_tokens": self.min_tokens,
                       "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                       "repetition_penalty": self.repetition_penalty != 1.0, "logit_bias": self.logit_bias,
                       "structured_outputs": self.structured_outputs, "bad_words": self.bad_words,
                       "allowed_token_ids": self.allowed_token_ids}
        for name, value in unsupported.items():
            if value:
                raise SamplingParamsError(name, f"{name} is not supported with use_beam_search")

    def check_token_ids(self, vocab_size: int) -> None:
        """SamplingParamsError for a token id these params name outside the model's vocabulary (the engine
        checks it on adding a request; a server before starting any of a request's prompts)."""
        for name, ids in (("logit_bias", self.logit_bias), ("allowed_token_ids", self.allowed_token_ids),
                          ("logprob_token_ids", self.logprob_token_ids)):
            if ids and max(ids) >= vocab_size:
                raise SamplingParamsError(name, f"{name} token id {max(ids)} is outside the vocabulary "
                                                f"[0, {vocab_size})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def prefill_only(self) -> SamplingParams:
        """A P/D prefill node's params: compute the prompt's KV and sample the first output token as
        monolithic serving would (the decode node streams it and continues from it: engine/outputs.py
        FirstToken), so everything that shapes that one token stays (seed, logit_bias, bad words,
        allowed tokens, penalties, structured outputs, min_tokens as far as one token, its logprobs);
        what only later tokens or other choices need goes."""
        return dataclasses.replace(self, n=1, max_tokens=1, min_tokens=min(self.min_tokens, 1), prompt_logprobs=None,
                                   use_beam_search=False)

    def for_choice(self, index: int) -> SamplingParams:
        """The params of choice `index` of an n > 1 request: n=1 and, when seeded, seed + index (as vLLM)."""
        seed = None if self.seed is None else self.seed + index
        return dataclasses.replace(self, n=1, seed=seed)
