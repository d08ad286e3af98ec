"""OpenAI-compatible request validation, transport-neutral: the supported parameters and their rules.

The node server and the routing proxy must accept exactly the same API, so the rules live here
once, as pure functions over JSON-decoded values (no HTTP library inside; responses.py formats
the answers, sse.py puts chunks on the wire, errors.py maps errors between transports). The
field readers and the error type are in protocol_fields.py, the chat fields in protocol_chat.py,
the prompt's tokenization options in protocol_prompt.py; the one table of supported fields is here.
"""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from pdserve.engine.sampling_params import BOUNDS, SamplingParams, SamplingParamsError, parse_logit_bias
from pdserve.serving.limits import check_prompt_chars
from pdserve.serving.protocol_chat import (CHAT_TEMPLATE_FIELDS, ChatTemplateOptions, parse_chat_template_options,
                                           parse_messages)
from pdserve.serving.protocol_fields import (  # noqa: F401 (APIError, error_body, ... are re-exported)
    MAX_COUNT, APIError, bad_request, bool_field, decode_json_body, error_body, int_field, int_value, is_int,
    model_not_found, number_value, service_unavailable, str_field, string_list, token_list)
from pdserve.serving.protocol_prompt import PROMPT_FIELDS, PromptOptions, parse_prompt_options
from pdserve.serving.structured_outputs import FIELDS as STRUCTURED_OUTPUT_FIELDS
from pdserve.serving.structured_outputs import parse_structured_outputs

COMPLETION, CHAT = "completion", "chat"
# X-Request-Id values honoured as given (printable ASCII, no spaces): the id starts every log line.
REQUEST_ID_RE = re.compile(r"[\x21-\x7e]{1,128}")
# The one list of request fields this server honours: OpenAI's and vLLM's names and meanings.
# Any other field is a 400 naming it (never silently ignored), except the OpenAI fields below
# at the value that means "off". tests/serving/test_openai_api.py walks the `openai` client's
# create() parameters against these tables.
_SAMPLING_FIELDS = (
    "model", "n", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "ignore_eos",
    "include_stop_str_in_output", "skip_special_tokens", "logprobs", "prompt_logprobs", "echo", "stream",
    "stream_options", "user", "cache_salt", "return_token_ids", "return_tokens_as_token_ids", "bad_words",
    "allowed_token_ids", "priority", "request_id", "use_beam_search", "length_penalty", "logprob_token_ids",
    *PROMPT_FIELDS, *STRUCTURED_OUTPUT_FIELDS)
SUPPORTED_PARAMETERS: dict[str, frozenset[str]] = {
    COMPLETION: frozenset(_SAMPLING_FIELDS + ("prompt",)),
    CHAT: frozenset(_SAMPLING_FIELDS + ("messages", "max_completion_tokens", "top_logprobs", "safety_identifier",
                                        *CHAT_TEMPLATE_FIELDS)),
}
# OpenAI fields for features this server does not have, accepted only at their "off" values.
NEUTRAL_PARAMETERS: dict[str, tuple[Any, ...]] = {
    "best_of": (1,), "suffix": ("",), "tools": ([],), "tool_choice": ("none",), "functions": ([],),
    "function_call": ("none",), "parallel_tool_calls": (True, False), "store": (False,), "metadata": ({},),
    "modalities": (["text"],), "service_tier": ("auto", "default"), "audio": (), "prediction": (),
    "reasoning_effort": (), "verbosity": (), "web_search_options": (), "moderation": (), "prompt_cache_key": (),
    "prompt_cache_options": (), "prompt_cache_retention": (),
}
MAX_BATCHED_PROMPTS = 1024
# Engine field -> the request field that carries it, where the names differ (completions' `logprobs` is
# the engine's top_logprobs): an engine error names what the client sent.
_REQUEST_FIELD = {COMPLETION: {"top_logprobs": "logprobs"}, CHAT: {}}


def _one_prompt(p: Any) -> str | list[int]:
    if isinstance(p, str):
        if not p:
            raise bad_request("prompt must not be empty", "prompt")
        return p
    ids = list(p) if isinstance(p, list) and p and all(is_int(t) for t in p) else None
    if ids is None:
        raise bad_request("prompt must be a non-empty string, a non-empty list of token ids, or a list of those",
                          "prompt")
    if any(t < 0 for t in ids):
        raise bad_request("prompt token ids must be non-negative integers", "prompt")
    return ids


def _parse_prompts(body: dict) -> list[str | list[int]]:
    """One prompt or a batch: a string, token ids, or a list of strings / of token-id lists."""
    if "prompt" not in body or body["prompt"] is None:
        raise bad_request("prompt is required", "prompt", "missing_required_parameter")
    p = body["prompt"]
    if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        if len(p) > MAX_BATCHED_PROMPTS:
            raise bad_request(f"at most {MAX_BATCHED_PROMPTS} prompts per request, got {len(p)}", "prompt")
        return [_one_prompt(x) for x in p]
    return [_one_prompt(p)]


def _parse_stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):  # empty ones: the engine's
        raise bad_request("stop must be a non-empty string or a list of non-empty strings", "stop")
    return stop


@dataclass
class GenerationRequest:
    """One validated /v1/completions or /v1/chat/completions body."""

    kind: str  # COMPLETION | CHAT
    model: str | None
    prompt: str | list[int] | None  # completions
    messages: list[dict[str, str]] | None  # chat
    max_tokens: int | None  # None: up to the context length
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage so far in every chunk
    logprobs: bool = False
    top_logprobs: int = 0  # most likely tokens reported per position
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False  # logprob tokens as "token_id:N" (vLLM's field and server flag)
    user: str | None = None
    cache_salt: str | None = None
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields except max_tokens
    # Completions with a list of prompts: every prompt (`prompt` is then the first); see per_prompt().
    prompts: list[str | list[int]] | None = None
    echo: bool = False  # completions: prompt (+ its logprobs) before the output; chat: vLLM's echo
    chat_template: ChatTemplateOptions = ChatTemplateOptions()  # chat: how the template renders the messages
    prompt_options: PromptOptions = PromptOptions()  # add_special_tokens, truncation
    request_id: str | None = None  # vLLM's body field: the request id when no X-Request-Id header names one
    priority: int = 0  # vLLM's field: accepted; this server schedules first come, first served
    # prompt_logprobs the client asked for (vLLM's field; `sampling` may ask more, for echo)
    prompt_logprobs: int | None = None
    structured_field: str | None = None  # the field structured outputs came from (errors name it)

    @property
    def n(self) -> int:
        return self.sampling.get("n", 1)

    def per_prompt(self) -> list[GenerationRequest]:
        """One request per prompt of a batch (itself when there is one prompt). Choice `i` of prompt
        `p` is choice `p * n + i` of the response, as OpenAI numbers them."""
        if not self.prompts or len(self.prompts) == 1:
            return [self]
        return [dataclasses.replace(self, prompt=p, prompts=None) for p in self.prompts]

    def sampling_params(self, prompt_len: int, max_model_len: int, vocab_size: int | None = None) -> SamplingParams:
        """Resolve max_tokens against the context and build the engine's params (400 on misfit);
        with `vocab_size` (nodes know it, the proxy does not) the token ids they name are checked too."""
        room = max_model_len - prompt_len
        if room < 1 or (self.max_tokens is not None and self.max_tokens > room):
            asked = "" if self.max_tokens is None else f" + {self.max_tokens} max_tokens"
            raise bad_request(f"This model's maximum context length is {max_model_len} tokens; the request "
                              f"has {prompt_len} prompt tokens{asked}. Shorten the prompt or lower max_tokens.",
                              "max_tokens" if room >= 1 else ("messages" if self.kind == CHAT else "prompt"),
                              "context_length_exceeded")
        try:
            params = SamplingParams(max_tokens=self.max_tokens or room, logprobs=self.logprobs,
                                    top_logprobs=self.top_logprobs, **self.sampling)
            if vocab_size is not None:
                params.check_token_ids(vocab_size)
            return params
        except SamplingParamsError as e:
            raise engine_bad_request(e, self.kind) from None


def check_prompt_size(req: GenerationRequest, max_model_len: int) -> None:
    """400 for a text prompt too long to fit the context whatever it tokenizes to, before tokenizing it
    (unless it is to be truncated)."""
    if req.prompt_options.truncate_prompt_tokens is not None:
        return
    if req.kind == CHAT:
        size, param = sum(len(m["content"]) for m in req.messages), "messages"
    else:
        size, param = max((len(p) for p in req.prompts or [req.prompt] if isinstance(p, str)), default=0), "prompt"
    try:
        check_prompt_chars(size, max_model_len)
    except ValueError as e:
        raise bad_request(str(e), param, "context_length_exceeded") from None


def parse_request(kind: str, raw: bytes | str | Any, check_grammar: bool = True,
                  return_tokens_as_token_ids: bool = False) -> GenerationRequest:
    """Validate a request body (raw JSON bytes or an already decoded object); raises APIError(400).

    `check_grammar=False` (the proxy) leaves compiling a structured-output grammar to the nodes;
    `return_tokens_as_token_ids` is the server's default (vLLM's --return-tokens-as-token-ids)."""
    body = decode_json_body(raw)
    _check_fields(kind, body)
    model = str_field(body, "model")
    prompts = None
    renames = dict(_REQUEST_FIELD[kind])
    if kind == CHAT:
        prompt, messages = None, parse_messages(body)
        completion_tokens = int_value(body, "max_completion_tokens", None)
        max_tokens = int_value(body, "max_tokens", None)
        if max_tokens is None:
            max_tokens, renames["max_tokens"] = completion_tokens, "max_completion_tokens"
        elif completion_tokens is not None:  # max_tokens wins; the other is held to the same bound
            _engine_checked(kind, lambda: BOUNDS["max_tokens"].check("max_completion_tokens", completion_tokens))
        top_logprobs = int_value(body, "top_logprobs", 0)
        logprobs = bool_field(body, "logprobs")
        if top_logprobs and not logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    else:
        prompts, messages = _parse_prompts(body), None
        prompt = prompts[0]
        max_tokens = int_value(body, "max_tokens", 16)
        top_logprobs = int_value(body, "logprobs", None)
        logprobs, top_logprobs = top_logprobs is not None, top_logprobs or 0
    stream, echo = bool_field(body, "stream"), bool_field(body, "echo")
    include_usage, continuous_usage = _parse_stream_options(body, stream)
    prompt_logprobs = int_value(body, "prompt_logprobs", None)
    if prompt_logprobs is not None and stream:
        raise bad_request("prompt_logprobs is not available with stream=true", "prompt_logprobs")
    structured, structured_field = parse_structured_outputs(body, bad_request, check_grammar)
    # JSON types here; every value's bound is the engine's (SamplingParams), checked below
    sampling = {
        "n": int_value(body, "n", 1),
        "temperature": number_value(body, "temperature", 1.0),
        "top_p": number_value(body, "top_p", 1.0),
        "top_k": int_value(body, "top_k", 0),
        "min_p": number_value(body, "min_p", 0.0),
        "seed": int_value(body, "seed", None),
        "stop": _parse_stop(body),
        "stop_token_ids": token_list(body, "stop_token_ids") or [],
        "ignore_eos": bool_field(body, "ignore_eos"),
        "presence_penalty": number_value(body, "presence_penalty", 0.0),
        "frequency_penalty": number_value(body, "frequency_penalty", 0.0),
        "repetition_penalty": number_value(body, "repetition_penalty", 1.0),
        "logit_bias": _parse_logit_bias(body),
        "min_tokens": int_value(body, "min_tokens", 0),
        "include_stop_str_in_output": bool_field(body, "include_stop_str_in_output"),
        "skip_special_tokens": bool_field(body, "skip_special_tokens", True),
        # echo with logprobs reports the prompt's logprobs too: the engine computes them
        "prompt_logprobs": max(prompt_logprobs or 0, top_logprobs) if echo and logprobs and kind == COMPLETION
        else prompt_logprobs,
        "structured_outputs": structured,
        "bad_words": string_list(body, "bad_words"),
        "allowed_token_ids": token_list(body, "allowed_token_ids"),
        "logprob_token_ids": token_list(body, "logprob_token_ids"),
        "use_beam_search": bool_field(body, "use_beam_search"),
        "length_penalty": number_value(body, "length_penalty", 1.0),
    }
    if sampling["use_beam_search"] and stream:  # the answer is known only once the search ends (as vLLM)
        raise bad_request("use_beam_search is not available with stream=true", "use_beam_search")
    # The engine's checks now, not only on the node: pd-proxy refuses what a node would, before any node
    # works on it. Without max_tokens (chat: up to the context) min_tokens meets the context later.
    _engine_checked(kind, lambda: SamplingParams(
        max_tokens=max(sampling["min_tokens"], 1) if max_tokens is None else max_tokens, logprobs=logprobs,
        top_logprobs=top_logprobs, **sampling), renames)
    return GenerationRequest(
        kind=kind, model=model, prompt=prompt, messages=messages, max_tokens=max_tokens,
        stream=stream, include_usage=include_usage, continuous_usage=continuous_usage,
        logprobs=logprobs, top_logprobs=top_logprobs, return_token_ids=bool_field(body, "return_token_ids"),
        return_tokens_as_token_ids=bool_field(body, "return_tokens_as_token_ids", return_tokens_as_token_ids),
        user=str_field(body, "user") or str_field(body, "safety_identifier"), cache_salt=str_field(body, "cache_salt"),
        sampling=sampling, prompts=prompts, echo=echo, prompt_logprobs=prompt_logprobs,
        structured_field=structured_field, prompt_options=parse_prompt_options(body),
        chat_template=parse_chat_template_options(body) if kind == CHAT else ChatTemplateOptions(),
        request_id=_parse_request_id(body), priority=int_field(body, "priority", 0, -(2**63), 2**63 - 1))


def _parse_request_id(body: dict) -> str | None:
    rid = body.get("request_id")
    if rid is not None and (not isinstance(rid, str) or not REQUEST_ID_RE.fullmatch(rid)):
        raise bad_request("request_id must be 1-128 printable ASCII characters without spaces", "request_id")
    return rid


def request_id_of(req: GenerationRequest, header_id: str | None, assigned: str) -> str:
    """vLLM's rule: the X-Request-Id header's id, else the body's request_id, else the one the server made."""
    return assigned if header_id or req.request_id is None else req.request_id



def _check_fields(kind: str, body: dict) -> None:
    """400 naming the first field this server would otherwise ignore."""
    supported = SUPPORTED_PARAMETERS[kind]
    for name, value in body.items():
        if name in supported or value is None:
            continue
        if name in NEUTRAL_PARAMETERS and value in NEUTRAL_PARAMETERS[name]:
            continue
        if name in NEUTRAL_PARAMETERS:
            raise bad_request(f"{name} is not supported by this server", name, "unsupported_parameter")
        raise bad_request(f"Unrecognized request argument supplied: {name}", name, "unsupported_parameter")


# stream_options keys: OpenAI's include_usage, vLLM's continuous_usage_stats; the others only at the
# value that means "off" (OpenAI's include_obfuscation padding).
_STREAM_OPTIONS_OFF = {"include_obfuscation": False}


def _parse_stream_options(body: dict, stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous usage: each chunk's usage so far, only with include_usage, as in
    vLLM); 400 for stream_options without stream=true (as vLLM) or a key it would ignore."""
    options = body.get("stream_options")
    if options is None:
        return False, False
    if not isinstance(options, dict):
        raise bad_request("stream_options must be an object", "stream_options")
    if not stream:
        raise bad_request("stream_options can only be set when stream=true", "stream_options")
    for key, value in options.items():
        if key in ("include_usage", "continuous_usage_stats") or value is None or \
                (key in _STREAM_OPTIONS_OFF and _STREAM_OPTIONS_OFF[key] is value):
            continue
        message = f"stream_options.{key}={json.dumps(value)} is not supported by this server" \
            if key in _STREAM_OPTIONS_OFF else f"Unrecognized stream_options key: {key}"
        raise bad_request(message, "stream_options", "unsupported_parameter")
    flags = {}
    for key in ("include_usage", "continuous_usage_stats"):
        flags[key] = options.get(key) or False
        if not isinstance(flags[key], bool):
            raise bad_request(f"stream_options.{key} must be a boolean, got {json.dumps(options[key])}",
                              "stream_options")
    return flags["include_usage"], flags["include_usage"] and flags["continuous_usage_stats"]


def _parse_logit_bias(body: dict) -> dict[int, float] | None:
    """OpenAI's {"token id": bias}, as the engine reads it (its ids against the vocabulary come later)."""
    v = body.get("logit_bias")
    if v is None:
        return None
    try:
        return parse_logit_bias(v)
    except SamplingParamsError as e:
        raise bad_request(str(e), e.param) from None


def engine_bad_request(e: SamplingParamsError, kind: str, renames: dict[str, str] | None = None) -> APIError:
    """The OpenAI 400 for a value the engine refused, naming the request field that carried it."""
    field = (renames or _REQUEST_FIELD[kind]).get(e.param, e.param)
    message = str(e)
    if field != e.param and message.startswith(e.param):
        message = field + message[len(e.param):]
    return bad_request(message, field)


def _engine_checked(kind: str, check: Callable[[], object], renames: dict[str, str] | None = None) -> None:
    try:
        check()
    except SamplingParamsError as e:
        raise engine_bad_request(e, kind, renames) from None


def check_model(model: str | None, served_names: list[str]) -> str:
    """The model name to answer with; 404 when the request names a model we do not serve."""
    if model is None or model in served_names:
        return model or served_names[0]
    raise model_not_found(model, served_names)