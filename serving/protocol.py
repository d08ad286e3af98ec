"""OpenAI-compatible request validation and response formatting (bodies and stream chunks), transport-neutral.

The node server and the routing proxy must accept and answer exactly the same API, so the
rules live here once, as pure functions over JSON-decoded values (no HTTP library inside;
sse.py puts the chunks on the wire, errors.py maps errors between transports).
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from engine.sampling_params import MAX_TOP_LOGPROBS, SamplingParams

COMPLETION, CHAT = "completion", "chat"
# X-Request-Id values honoured as given (printable ASCII, no spaces): the id starts every log line.
REQUEST_ID_RE = re.compile(r"[\x21-\x7e]{1,128}")
# Accepted OpenAI fields we do not implement: allowed only at their neutral value.
_NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0, "best_of": 1, "echo": False, "logit_bias": {},
            "suffix": None, "tools": [], "functions": []}
_CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")


class APIError(Exception):
    """An error the client caused or must be told about; `body()` is OpenAI's error shape."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(name: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")


def service_unavailable(message: str, code: str) -> APIError:
    return APIError(503, message, type="service_unavailable_error", code=code)


# ---------------------------------------------------------------- request parsing

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool))


def _int(body: dict, name: str, default: int | None, lo: int | None = None, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v):
        raise bad_request(f"{name} must be an integer, got {json.dumps(v)}", name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise bad_request(f"{name} must be {bounds}, got {v}", name)
    return v


def _float(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not _is_number(v):
        raise bad_request(f"{name} must be a number, got {json.dumps(v)}", name)
    if v > hi or v < lo or (lo_open and v == lo):
        raise bad_request(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}", name)
    return float(v)


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"{name} must be a boolean, got {json.dumps(v)}", name)
    return v


def _str(body: dict, name: str, max_len: int = 4096) -> str | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, str) or len(v) > max_len:
        raise bad_request(f"{name} must be a string of at most {max_len} characters", name)
    return v


def _token_ids(v: Any, name: str) -> list[int] | None:
    if isinstance(v, list) and v and all(_is_int(t) for t in v):
        if any(t < 0 for t in v):
            raise bad_request(f"{name} token ids must be non-negative integers", name)
        return list(v)
    return None


def _parse_prompt(body: dict) -> str | list[int]:
    if "prompt" not in body or body["prompt"] is None:
        raise bad_request("prompt is required", "prompt", "missing_required_parameter")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and (isinstance(p[0], str) or isinstance(p[0], list)):
        p = p[0]  # a batch of one
    elif isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        raise bad_request("batched prompts are not supported: send one prompt per request", "prompt")
    if isinstance(p, str):
        if not p:
            raise bad_request("prompt must not be empty", "prompt")
        return p
    ids = _token_ids(p, "prompt")
    if ids is None:
        raise bad_request("prompt must be a non-empty string or a non-empty list of token ids", "prompt")
    return ids


def _content_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(c, dict) and c.get("type") == "text"
                                         and isinstance(c.get("text"), str) for c in content):
        return "".join(c["text"] for c in content)
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts", "messages")


def _parse_messages(body: dict) -> list[dict[str, str]]:
    msgs = body.get("messages")
    if msgs is None:
        raise bad_request("messages is required", "messages", "missing_required_parameter")
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in _CHAT_ROLES:
            raise bad_request(f"messages[{i}] must be an object with a role in {', '.join(_CHAT_ROLES)}",
                              "messages")
        out.append({"role": m["role"], "content": _content_text(m.get("content", ""), i)})
    return out


def _parse_stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
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
    logprobs: bool = False
    top_logprobs: int = 0  # most likely tokens reported per position
    return_token_ids: bool = False
    user: str | None = None
    cache_salt: str | None = None
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields except max_tokens

    def sampling_params(self, prompt_len: int, max_model_len: int) -> SamplingParams:
        """Resolve max_tokens against the context and build the engine's params (400 on misfit)."""
        room = max_model_len - prompt_len
        if room < 1 or (self.max_tokens is not None and self.max_tokens > room):
            asked = "" if self.max_tokens is None else f" + {self.max_tokens} max_tokens"
            raise bad_request(f"This model's maximum context length is {max_model_len} tokens; the request "
                              f"has {prompt_len} prompt tokens{asked}. Shorten the prompt or lower max_tokens.",
                              "max_tokens" if room >= 1 else ("messages" if self.kind == CHAT else "prompt"),
                              "context_length_exceeded")
        try:
            return SamplingParams(max_tokens=self.max_tokens or room, logprobs=self.logprobs,
                                  top_logprobs=self.top_logprobs, **self.sampling)
        except ValueError as e:
            raise bad_request(str(e)) from None


def parse_request(kind: str, raw: bytes | str | Any) -> GenerationRequest:
    """Validate a request body (raw JSON bytes or an already decoded object); raises APIError(400)."""
    if isinstance(raw, (bytes, str)):
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise bad_request(f"request body is not valid JSON: {e}", code="invalid_json") from None
    else:
        body = raw
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    for name, neutral in _NEUTRAL.items():
        if body.get(name) not in (None, neutral):
            raise bad_request(f"{name} is not supported by this server", name, "unsupported_parameter")
    if _int(body, "n", 1) != 1:
        raise bad_request("n must be 1: only one choice per request is supported", "n")
    model = _str(body, "model")
    if kind == CHAT:
        prompt, messages = None, _parse_messages(body)
        max_tokens = _int(body, "max_completion_tokens", None, 1)
        max_tokens = _int(body, "max_tokens", max_tokens, 1)
        top_logprobs = _int(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
        logprobs = _bool(body, "logprobs")
        if top_logprobs and not logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    else:
        prompt, messages = _parse_prompt(body), None
        max_tokens = _int(body, "max_tokens", 16, 1)
        top_logprobs = _int(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
        logprobs, top_logprobs = top_logprobs is not None, top_logprobs or 0
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise bad_request("stream_options must be an object", "stream_options")
    sampling = {
        "temperature": _float(body, "temperature", 1.0, 0.0, 2.0),
        "top_p": _float(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        "top_k": _int(body, "top_k", 0, -1),
        "seed": _int(body, "seed", None),
        "stop": _parse_stop(body),
        "ignore_eos": _bool(body, "ignore_eos"),
    }
    return GenerationRequest(
        kind=kind, model=model, prompt=prompt, messages=messages, max_tokens=max_tokens,
        stream=_bool(body, "stream"), include_usage=_bool(stream_options or {}, "include_usage"),
        logprobs=logprobs, top_logprobs=top_logprobs, return_token_ids=_bool(body, "return_token_ids"), user=_str(body, "user"),
        cache_salt=_str(body, "cache_salt"), sampling=sampling)


def check_model(req: GenerationRequest, served_names: list[str]) -> str:
    """The model name to answer with; 404 when the request names a model we do not serve."""
    if req.model is None or req.model in served_names:
        return req.model or served_names[0]
    raise model_not_found(req.model)


# ---------------------------------------------------------------- responses

def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def models_list(names: list[str], max_model_len: int, created: int) -> dict[str, Any]:
    """Lists the first (public) name only: the others are accepted aliases, such as the model's path."""
    return {"object": "list", "data": [{"id": names[0], "object": "model", "created": created,
                                        "owned_by": "pdserve", "max_model_len": max_model_len}]}


@dataclass
class Delta:
    """New output of one request since the last delta (what the engine or a decode node streams)."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tokens: list[str] | None = None  # token strings for logprobs; None: not available
    top_logprobs: list[list[tuple[str, float]]] = field(default_factory=list)  # per token, best first
    finish_reason: str | None = None


def top_token_texts(decode: Callable[[list[int]], str],
                    tops: list[list[tuple[int, float]]]) -> list[list[tuple[str, float]]]:
    """The engine's (token id, logprob) lists with each id decoded alone, as the sampled tokens are."""
    return [[(decode([t]), lp) for t, lp in top] for top in tops]


def top_by_text(top: list[tuple[str, float]]) -> dict[str, float]:
    """Completions key top tokens by text: ids that decode alike (partial UTF-8) keep the best logprob."""
    out: dict[str, float] = {}
    for text, logprob in top:
        out.setdefault(text, logprob)
    return out


class ResponseBuilder:
    """Formats one request's answer: SSE chunks while streaming, or the final JSON body."""

    def __init__(self, req: GenerationRequest, request_id: str, model: str, created: int | None = None) -> None:
        self.req = req
        self.id = ("chatcmpl-" if req.kind == CHAT else "cmpl-") + request_id
        self.model = model
        self.created = int(time.time()) if created is None else created
        self._text_offset = 0  # completions logprobs: character offset of the next token

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def _logprobs(self, d: Delta) -> dict[str, Any] | None:
        if not self.req.logprobs:
            return None
        tokens = d.tokens if d.tokens is not None else [""] * len(d.logprobs)
        tops = d.top_logprobs or [[] for _ in tokens]
        if self.req.kind == CHAT:
            return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                                 "top_logprobs": [{"token": tt, "logprob": tlp, "bytes": list(tt.encode())}
                                                  for tt, tlp in top]}
                                for t, lp, top in zip(tokens, d.logprobs, tops)]}
        offsets = []
        for t in tokens:
            offsets.append(self._text_offset)
            self._text_offset += len(t)
        return {"tokens": tokens, "token_logprobs": d.logprobs, "text_offset": offsets,
                "top_logprobs": [top_by_text(top) for top in tops] if self.req.top_logprobs else None}

    def _choice(self, d: Delta, *, stream: bool, role: bool = False) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.req.kind == CHAT:
            message = {"role": "assistant", "content": d.text} if (role or not stream) else (
                {"content": d.text} if d.text else {})
            choice["delta" if stream else "message"] = message
        else:
            choice["text"] = d.text
        choice["logprobs"] = self._logprobs(d)
        choice["finish_reason"] = d.finish_reason
        if self.req.return_token_ids:
            choice["token_ids"] = d.token_ids
        return choice

    def chunk(self, d: Delta, *, role: bool = False) -> dict[str, Any]:
        """A streaming chunk; `role=True` for a chat stream's first chunk."""
        obj = "chat.completion.chunk" if self.req.kind == CHAT else "text_completion"
        out = self._envelope(obj, [self._choice(d, stream=True, role=role)])
        if self.req.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The extra last chunk of `stream_options.include_usage`: no choices, only usage."""
        obj = "chat.completion.chunk" if self.req.kind == CHAT else "text_completion"
        out = self._envelope(obj, [])
        out["usage"] = usage
        return out

    def response(self, d: Delta, usage: dict[str, Any], prompt_token_ids: list[int] | None = None) -> dict:
        """The non-streaming body; `d` holds the whole output."""
        obj = "chat.completion" if self.req.kind == CHAT else "text_completion"
        out = self._envelope(obj, [self._choice(d, stream=False)])
        if self.req.return_token_ids and prompt_token_ids is not None:
            out["prompt_token_ids"] = prompt_token_ids
        out["usage"] = usage
        return out
