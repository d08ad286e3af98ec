"""The one error table: how an OpenAI API error crosses the engine, gRPC and HTTP.

An APIError (serving.protocol) is what a client is told. The engine raises its own exceptions,
mapped to APIErrors here; a node sends an APIError to the proxy as a gRPC status whose details
carry the JSON body, and the proxy maps it back here, so a client behind the proxy gets
exactly what pd-serve would have answered.
"""
from __future__ import annotations

import json

import grpc

from pdserve.engine.sampling_params import SamplingParamsError
from pdserve.serving.protocol import CHAT, APIError, bad_request, engine_bad_request, service_unavailable

# HTTP status -> gRPC status code of a node's answer; a full queue is RESOURCE_EXHAUSTED, others UNAVAILABLE.
class StartupError(Exception):
    """A one-line reason a process cannot start (bad model directory, port taken, store unreachable)."""


_GRPC_CODE = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND,
              503: grpc.StatusCode.UNAVAILABLE}
_HTTP_STATUS = {**{code: status for status, code in _GRPC_CODE.items()}, grpc.StatusCode.RESOURCE_EXHAUSTED: 503}


def outcome(err: APIError) -> str:
    """The request outcome counted on /metrics for a failed request."""
    return "rejected" if err.status == 503 else ("invalid" if err.status < 500 else "error")


def grpc_code(err: APIError) -> grpc.StatusCode:
    """The status a node aborts a gRPC call with; its details are `json.dumps(err.body())`."""
    if err.code == "queue_full":
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    return _GRPC_CODE.get(err.status, grpc.StatusCode.UNAVAILABLE)


def from_rpc_error(e: grpc.aio.AioRpcError) -> APIError | None:
    """The APIError a node reported (its JSON body rides in the status details), else None."""
    status = _HTTP_STATUS.get(e.code())
    try:
        err = json.loads(e.details() or "")["error"]
    except (ValueError, KeyError, TypeError):
        return None
    if status is None or not isinstance(err, dict) or "message" not in err:
        return None
    return APIError(status, err["message"], type=err.get("type"), param=err.get("param"), code=err.get("code"))


def from_engine_error(e: Exception, kind: str) -> APIError | None:
    """The APIError for an exception AsyncLLMEngine raised before a request produced output.

    None for RequestAbortedError: a server-side abort is answered by each transport its own way
    once a stream has started. (Imported here, not at the top: the proxy uses this module and
    never loads the engine.)
    """
    from pdserve.engine.async_engine import EngineOverloadedError, EngineShutdownError, RequestAbortedError

    if isinstance(e, EngineOverloadedError):
        return service_unavailable(str(e), "queue_full")
    if isinstance(e, EngineShutdownError):
        return service_unavailable(str(e), "shutting_down")
    if isinstance(e, RequestAbortedError):
        return service_unavailable(str(e), "aborted")
    if isinstance(e, SamplingParamsError):  # a value out of the engine's bounds: the 400 names its field
        return engine_bad_request(e, kind)
    if isinstance(e, ValueError):  # the engine refused the prompt
        return bad_request(str(e), "messages" if kind == CHAT else "prompt")
    return None
