"""Cheap bounds on a request, checked before any real work (validation, tokenizing, the engine).

A request body, a header and a prompt each have a size limit, and a JSON body a nesting limit,
so that bad or hostile input costs microseconds and a 4xx in OpenAI's shape, never a traceback,
a 500 or seconds of tokenizing that slow everyone else down. The node server and the proxy both
apply them (serving.protocol.parse_request decodes through `decode_json`). `HttpTimeouts` bounds
the time a client may take over a request's headers and body and an idle connection may stay
(serving/http_edge.py applies them; docs/http-limits.md lists every bound).
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

MAX_BODY_BYTES = 8 << 20  # a request body; larger is 413 (a long prompt as token ids is ~7 bytes a token)
MAX_HEADER_BYTES = 32 << 10  # one header line: larger is refused by the HTTP parser itself
MAX_JSON_DEPTH = 32  # nesting of a request body; OpenAI's deepest (tools, schemas) is far below
# A text prompt longer than this many characters per token of context cannot fit (tokens of real
# vocabularies average 3-5 characters): refused before tokenizing.
MAX_CHARS_PER_TOKEN = 32


class RequestTooLarge(ValueError):
    """Raised with a message for the client; the caller answers 413."""


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


def decode_json(raw: bytes | str) -> Any:
    """json.loads with JSON's own rules (no NaN/Infinity), bounded nesting and valid Unicode strings.

    ValueError (with a message for the client) for anything else; never RecursionError or a
    string that cannot be encoded later (a lone UTF-16 surrogate escape like "\\ud800")."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise ValueError(f"request body is nested more than {MAX_JSON_DEPTH} levels deep") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"request body is not UTF-8: {e.reason} at byte {e.start}") from None
    _check(body, 0)
    return body


def _check(value: Any, depth: int) -> None:
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"request body is nested more than {MAX_JSON_DEPTH} levels deep")
    if isinstance(value, str):
        _check_text(value)
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, (list, dict, str)):
                _check(item, depth + 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key)
            if isinstance(item, (list, dict, str)):
                _check(item, depth + 1)


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"request body holds an invalid string: a lone surrogate {text[e.start]!a} "
                         f"(\\u escapes must pair up)") from None


def check_prompt_chars(num_chars: int, max_model_len: int) -> None:
    """Refuse, before tokenizing, a text prompt that cannot fit the context whatever its tokens."""
    limit = max_model_len * MAX_CHARS_PER_TOKEN
    if num_chars > limit:
        raise ValueError(f"the prompt has {num_chars} characters: it cannot fit this model's context of "
                         f"{max_model_len} tokens (at most {limit} characters are accepted)")


# ---------------------------------------------------------------- time bounds of the HTTP edge

@dataclass(frozen=True)
class HttpTimeouts:
    """How long a client may take over each part of an HTTP request, and how long an idle connection stays.

    A client that sends its headers or its body byte by byte (slowloris), or opens connections and
    sends nothing, would otherwise hold a connection (a file descriptor and a parser) for as long as
    it likes. The proxy, pd-serve and the nodes' HTTP ports apply them (serving/http_edge.py).
    """

    header_s: float = 10.0  # from a connection's accept (its first request) or a request's first byte
    body_s: float = 60.0  # from the end of the headers to the end of the body (8 MiB at ~1 Mbit/s)
    keep_alive_s: float = 75.0

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not value > 0:
                raise ValueError(f"{_TIMEOUT_FLAGS[name]} must be a positive number of seconds, got {value:g}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> HttpTimeouts:
        return cls(args.timeout_request_header, args.timeout_request_body, args.timeout_keep_alive)


_TIMEOUT_FLAGS = {"header_s": "--timeout-request-header", "body_s": "--timeout-request-body",
                  "keep_alive_s": "--timeout-keep-alive"}


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text}")
    return value


_seconds.__name__ = "seconds"


def add_http_timeout_args(parser: argparse.ArgumentParser) -> None:
    """The HTTP edge's deadlines (uvicorn's --timeout-keep-alive and its spelling for the other two)."""
    d = HttpTimeouts()
    g = parser.add_argument_group("HTTP deadlines")
    g.add_argument("--timeout-request-header", type=_seconds, default=d.header_s, metavar="S",
                   help=f"seconds a client may take to send a request's headers; later it gets 408 and the "
                        f"connection is closed (default {d.header_s:g})")
    g.add_argument("--timeout-request-body", type=_seconds, default=d.body_s, metavar="S",
                   help=f"seconds a client may take to send a request's body once its headers are in; later "
                        f"it gets 408 (default {d.body_s:g})")
    g.add_argument("--timeout-keep-alive", type=_seconds, default=d.keep_alive_s, metavar="S",
                   help=f"seconds an idle keep-alive connection stays open (default {d.keep_alive_s:g})")
