"""The HTTP plumbing shared by pd-serve, the P/D nodes and pd-proxy: one middleware, one serve loop.

The middleware gives every request an id (X-Request-Id honoured or generated; it starts every
log line about the request and is echoed back), answers every failure in OpenAI's error shape
(never a traceback), a body that cannot be read (corrupt gzip, broken chunking, past its
deadline) included, and writes one log line per finished request. It also answers `Expect`:
413 when the announced body is over the limit, before the client sends it. The serve loop runs
an aiohttp app on an already bound socket, behind serving/http_edge.py's deadlines, until
SIGINT/SIGTERM, then drains.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Awaitable, Callable

from aiohttp import web

from pdserve.serving import errors
from pdserve.serving.auth import check_http_api_key
from pdserve.serving.errors import StartupError
from pdserve.serving.http_edge import CLOSE, EXPECT, BodyTimeout, listen
from pdserve.serving.limits import MAX_BODY_BYTES, MAX_HEADER_BYTES, HttpTimeouts
from pdserve.serving.protocol import REQUEST_ID_RE, APIError, bad_request, error_body

logger = logging.getLogger(__name__)


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(obj), status=status, content_type="application/json")


def api_middleware(on_outcome: Callable[[web.Request, str], None] | None = None,
                   api_key: str | None = None) -> Any:
    """The middleware of every OpenAI-speaking app.

    Handlers may set `request["outcome"]` (finish reason) and `request["summary"]` (text for the
    log line); failures set them here. `on_outcome(request, outcome)` then sees every finished
    request (pd-serve counts them by outcome) unless its handler counted it itself (it sets
    `request["counted"]`). With `api_key`, /v1/* needs `Authorization: Bearer KEY`.
    """
    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        start = time.monotonic()
        request["outcome"] = None
        response: web.StreamResponse | None = None
        try:
            if not REQUEST_ID_RE.fullmatch(rid):
                rid = uuid.uuid4().hex
                raise bad_request("X-Request-Id must be 1-128 printable ASCII characters without spaces")
            request["request_id"] = rid
            check_http_api_key(request, api_key)
            await _admit_body(request)
            try:
                response = await handler(request)
            except (web.RequestPayloadError, BodyTimeout, web.HTTPRequestEntityTooLarge) as e:  # reading the body
                raise _body_error(request, e) from None
        except APIError as e:
            response = json_response(e.body(), e.status)
            request["outcome"] = errors.outcome(e)
            request["summary"] = f", {e.code or e.type}: {e.message}"
        except web.HTTPException as e:  # routing (404/405), body too large (413), ...
            response = json_response(error_body(e.reason, "invalid_request_error", None, str(e.status)), e.status)
            request["outcome"] = "invalid"
        except asyncio.CancelledError:
            request["outcome"] = "abort"  # the client went away; closing the handler's generators aborted its work
            raise
        except ConnectionResetError:  # same, noticed while writing a stream
            request["outcome"] = "abort"
            response = request.get("sse")
            if response is None:
                raise
        except Exception:
            logger.exception("Reqid: %s, %s %s failed", request.get("request_id", rid), request.method, request.path)
            request["outcome"] = "error"
            response = json_response(error_body("internal server error", "server_error", None, "internal_error"), 500)
        finally:
            if request["outcome"]:
                if on_outcome is not None and not request.get("counted"):  # counted: the handler did it
                    on_outcome(request, request["outcome"])
                # the handler may have named the request from its body (vLLM's request_id field)
                logger.info("Reqid: %s, %s -> %s, outcome %s, %.1f ms%s", request.get("request_id", rid), request.path,
                            response.status if response is not None else "client gone", request["outcome"],
                            (time.monotonic() - start) * 1e3, request.get("summary", ""))
        if not response.prepared:
            response.headers["X-Request-Id"] = request.get("request_id", rid)
        return response

    return middleware


async def _admit_body(request: web.Request) -> None:
    """Refuse a body announced over the limit before reading it; answer `Expect: 100-continue` (aiohttp's
    own answer would send `100 Continue` to any size: serving/http_edge.py keeps the header from it)."""
    expect = request.get(EXPECT)
    length = request.content_length
    if length is not None and length > MAX_BODY_BYTES:  # (without Expect aiohttp reads the rest and drops it)
        raise APIError(413, f"the request body is {length} bytes; at most {MAX_BODY_BYTES} are accepted",
                       code="request_too_large")
    if expect is None:
        return
    if expect.lower() != "100-continue":
        raise APIError(417, f"Expect: {expect[:64]!r} is not supported (only 100-continue is)",
                       code="expectation_failed")
    if request.version >= (1, 1) and request.body_exists:
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # (as aiohttp's handler does: the answer itself has not started)
    request[CLOSE] = False


def _body_error(request: web.Request, e: Exception) -> APIError:
    """The 4xx of a body that could not be read: past its deadline (408), too large (413), or bytes that are
    no body (400)."""
    if isinstance(e, BodyTimeout):
        return APIError(408, str(e), code="request_timeout")
    if isinstance(e, web.HTTPRequestEntityTooLarge):  # a body without Content-Length, or a zip bomb
        return APIError(413, f"the request body is over {MAX_BODY_BYTES} bytes (after decompression)",
                        code="request_too_large")
    reason = str(e).rpartition("message:")[2].strip()  # aiohttp's "400, message:\n  <reason>"
    reason = reason.splitlines()[0][:200] if reason else type(e).__name__
    encoding = request.headers.get("Content-Encoding", "")[:32]
    if encoding and "decode" in reason:
        return bad_request(f"the request body is not valid {encoding} data (Content-Encoding: {encoding})",
                           code="invalid_request_body")
    return bad_request(f"the request body could not be read: {reason}", code="invalid_request_body")


def listen_socket(host: str, port: int, what: str = "") -> socket.socket:
    """Bind before anything slow happens, so a taken port fails start-up at once. Never SO_REUSEPORT: a port
    another process holds, even with SO_REUSEPORT set (as grpc sets it by default), is refused."""
    try:
        sock = socket.create_server((host, port), reuse_port=False)
    except OSError as e:
        raise StartupError(f"cannot listen on {host}:{port}{f' ({what})' if what else ''}: "
                           f"{e.strerror or e}") from None
    sock.setblocking(False)
    return sock


# What stopping may take after the drain's own bound (an engine's shutdown, its ranks, the gRPC server, the
# handlers' end) before a server that stops with a bound (`stop_within_s`) gives up on it (docs/operations.md).
STOP_GRACE_S = 5.0


def _own_children() -> set[int]:
    """This process's live children (a node's -tp/-pp ranks), from /proc."""
    found: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        try:
            found |= {int(c) for c in (task / "children").read_text().split()}
        except OSError:
            pass
    return found


def _exit_by(deadline: float, prog: str, bound_s: float) -> None:
    """From a signal on: a process still running at `deadline` (time.monotonic) kills its children and exits 1.
    A thread, not the event loop: what overruns may be a thread the loop waits on (an engine step blocked in a
    collective with a rank that does not answer)."""
    def watch() -> None:
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(left)
        children = _own_children()
        logger.critical("%s did not stop within %g s of the signal; killing %s and exiting", prog, bound_s,
                        f"its child processes {sorted(children)}" if children else "nothing else")
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)  # a stopped (SIGSTOPped) process dies of it too
            except OSError:
                pass
        logging.shutdown()
        os._exit(1)

    threading.Thread(target=watch, name="exit-watch", daemon=True).start()


async def serve_app(app: web.Application, sock: socket.socket, prog: str,
                    details: Callable[[], str], drain: Callable[[], Awaitable[None]] | None = None,
                    handler_timeout_s: float = 60.0, timeouts: HttpTimeouts = HttpTimeouts(),
                    stop_within_s: float | None = None) -> None:
    """Serve `app` on `sock` until SIGINT/SIGTERM; `drain` lets in-flight work finish before the app stops.

    The ready line, "<prog> ready at http://host:port <details()>", is what operators and tests
    wait for. Handlers still running after `drain` get `handler_timeout_s` more before they are cancelled.
    `timeouts`: how long clients may take over headers and bodies, and idle connections stay.
    `stop_within_s`: the process is gone that long after the signal whatever still runs (its children
    killed, exit status 1).
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # Header lines up to MAX_HEADER_BYTES reach the middleware, which answers a bad one in OpenAI's shape.
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=handler_timeout_s)
    await runner.setup()
    listener = await listen(runner, sock, timeouts, access_log=None, max_line_size=MAX_HEADER_BYTES,
                            max_field_size=MAX_HEADER_BYTES)
    host, port = sock.getsockname()[:2]
    logger.info("%s ready at http://%s:%d %s (HTTP deadlines: headers %g s, body %g s, keep-alive %g s)", prog,
                host, port, details(), timeouts.header_s, timeouts.body_s, timeouts.keep_alive_s)
    await stop.wait()
    if stop_within_s is not None:
        _exit_by(time.monotonic() + stop_within_s, prog, stop_within_s)
    if drain is not None:  # (new requests meanwhile get 503)
        await drain()
    else:
        logger.info("%s shutting down", prog)
    listener.close()
    await runner.cleanup()
    logger.info("%s stopped", prog)
