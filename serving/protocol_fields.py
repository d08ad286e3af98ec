"""The OpenAI API's error type and the typed readers every request field goes through.

Pure functions over JSON-decoded values (no HTTP library): serving/protocol.py and its siblings
(protocol_chat.py, protocol_prompt.py, protocol_beam.py) validate with them, so a bad value is
the same 400, naming the same field, on pd-serve, on a node and on pd-proxy.
"""
from __future__ import annotations

import json
from typing import Any

from pdserve.engine.sampling_params import MAX_COUNT
from pdserve.serving.limits import decode_json


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


def model_not_found(name: str, served_names: list[str]) -> APIError:
    """vLLM's 404 (type NotFoundError, its message) followed by the names this server answers to."""
    return APIError(404, f"The model `{name}` does not exist. Served model names: {', '.join(served_names)}",
                    type="NotFoundError", param="model", code="model_not_found")


def service_unavailable(message: str, code: str) -> APIError:
    return APIError(503, message, type="service_unavailable_error", code=code)


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def int_field(body: dict, name: str, default: int | None, lo: int | None = None, hi: int = MAX_COUNT) -> int | None:
    """An integer in [lo, hi] (hi: the wire's int32 unless given): for fields the HTTP layer bounds."""
    v = int_value(body, name, default)
    if v is not None and ((lo is not None and v < lo) or v > hi):
        bounds = f"<= {hi}" if lo is None else f"in [{lo}, {hi}]"
        raise bad_request(f"{name} must be {bounds}, got {v}", name)
    return v


def int_value(body: dict, name: str, default: int | None) -> int | None:
    """An integer, unbounded here: a sampling field, whose bound is the engine's (engine/sampling_params.py
    BOUNDS; the request's SamplingParams are built at parse time, so pd-proxy refuses what a node would)."""
    v = body.get(name)
    if v is None:
        return default
    if not is_int(v):
        raise bad_request(f"{name} must be an integer, got {json.dumps(v)}", name)
    return v


def number_value(body: dict, name: str, default: float) -> float:
    """A number (JSON's are finite: decode_json refuses the rest), as the client wrote it (an error then
    quotes 2, not 2.0); like int_value, a sampling field whose bound is the engine's."""
    v = body.get(name)
    if v is None:
        return default
    if not is_number(v):
        raise bad_request(f"{name} must be a number, got {json.dumps(v)}", name)
    return v


def bool_field(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"{name} must be a boolean, got {json.dumps(v)}", name)
    return v


def optional_bool(body: dict, name: str) -> bool | None:
    """A boolean whose absence means "the server's default" (None)."""
    return None if body.get(name) is None else bool_field(body, name)


def str_field(body: dict, name: str, max_len: int = 4096) -> str | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, str) or len(v) > max_len:
        raise bad_request(f"{name} must be a string of at most {max_len} characters", name)
    return v


def token_list(body: dict, name: str) -> list[int] | None:
    """A list of integers (token ids); None when absent. Which ids are valid is the engine's rule."""
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, list) or not all(is_int(t) for t in v):
        raise bad_request(f"{name} must be a list of non-negative token ids", name)
    return list(v)


def string_list(body: dict, name: str) -> list[str]:
    """A list of strings; [] when absent. The engine refuses empty ones."""
    v = body.get(name)
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad_request(f"{name} must be a list of non-empty strings", name)
    return list(v)


def decode_json_body(raw: bytes | str | Any) -> dict[str, Any]:
    """A request body as a JSON object (raw bytes/text, or already decoded); 400 otherwise."""
    if isinstance(raw, (bytes, str)):
        try:
            body = decode_json(raw)  # bounded nesting, finite numbers, encodable strings
        except json.JSONDecodeError as e:
            raise bad_request(f"request body is not valid JSON: {e}", code="invalid_json") from None
        except ValueError as e:  # valid JSON beyond our bounds; the message says which
            raise bad_request(str(e), code="invalid_json") from None
    else:
        body = raw
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    return body
