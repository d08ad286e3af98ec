"""The HTTP connection's edge: deadlines for slow clients, OpenAI-shaped answers to what no handler sees.

aiohttp's per-connection server (web.RequestHandler) lets a client send its headers or body a byte
at a time for as long as it likes (its one timer closes idle keep-alive connections, after an
hour), and answers what its parser refuses (a malformed request line or header, an unsupported
Content-Encoding) with a plain-text 400 that never reaches the middleware. `EdgeProtocol` is that
server with both fixed (deadlines: serving/limits.py `HttpTimeouts`):

- a connection's first request must have sent its headers `header_s` after the accept, every later
  one `header_s` after its first byte; otherwise 408 and the connection is closed (one that sent
  nothing at all is just closed);
- a body must be in `body_s` after its headers: otherwise the handler's read raises BodyTimeout,
  which the middleware answers 408 (serving/http.py);
- an idle keep-alive connection is closed after `keep_alive_s`;
- a request whose body could not be read (undecodable gzip, broken chunking, the deadline) ends its
  connection once its answer is out, instead of aiohttp lingering on it (and logging a traceback);
- whatever aiohttp would answer itself is answered in OpenAI's error shape with one log line.

`edge_request_factory` also takes the `Expect` header away from aiohttp, whose default handler sends
`100 Continue` before anything looked at the request: the middleware answers it instead (413 when
the announced body is over the limit, before the client sends it).
"""
from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any, Callable

from aiohttp import hdrs, web
from aiohttp.http_exceptions import BadHttpMethod, ContentEncodingError, HttpProcessingError, LineTooLong
from multidict import CIMultiDict, CIMultiDictProxy

from pdserve.serving.limits import MAX_HEADER_BYTES, HttpTimeouts
from pdserve.serving.protocol import error_body

logger = logging.getLogger(__name__)

EXPECT = "pdserve.expect"  # request key: the Expect header aiohttp did not see (serving/http.py answers it)
CLOSE = "pdserve.close"  # request key: True ends the connection with the answer, the body unread

# Where a connection is; what its timer means.
_ACCEPTED, _HEADERS, _BODY, _BUSY, _DRAIN, _IDLE = range(6)


class BodyTimeout(TimeoutError):
    """The request body was not complete within its deadline (raised by the handler's read)."""


def _json_response(status: int, message: str, code: str, rid: str) -> web.Response:
    body = error_body(message, "invalid_request_error" if status < 500 else "server_error", None, code)
    return web.Response(status=status, text=json.dumps(body), content_type="application/json",
                        headers={"X-Request-Id": rid})


def _refusal(exc: BaseException | None, message: str | None) -> str:
    """What the client is told about a request the parser refused (aiohttp's own words are for developers)."""
    if isinstance(exc, ContentEncodingError):
        return "unsupported Content-Encoding (gzip, deflate and identity are supported)"
    if isinstance(exc, LineTooLong):
        return f"a request line or header is too long (at most {MAX_HEADER_BYTES} bytes)"
    text = str((exc.message if isinstance(exc, HttpProcessingError) else message) or "").strip()
    return f"malformed HTTP request: {text.splitlines()[0][:200].rstrip(':') if text else 'unreadable'}"


def _peer(address: Any) -> str:
    return f"{address[0]}:{address[1]}" if isinstance(address, tuple) else str(address)


class EdgeProtocol(web.RequestHandler):
    """aiohttp's RequestHandler (one per connection) with the deadlines and error shape described above."""

    __slots__ = ("_timeouts", "_phase", "_timer", "_payload")

    def __init__(self, manager: web.Server, *, timeouts: HttpTimeouts, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._timeouts = timeouts
        self._phase = _ACCEPTED
        self._timer: asyncio.TimerHandle | None = None
        self._payload: Any = None  # the current request's body stream

    # ------------------------------------------------------------ the phases of a connection
    def _arm(self, phase: int, delay_s: float | None) -> None:
        self._phase = phase
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None if delay_s is None else asyncio.get_running_loop().call_later(delay_s, self._expired)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm(_ACCEPTED, self._timeouts.header_s)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._arm(_IDLE, None)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if data and self._phase == _IDLE:  # a keep-alive connection's next request begins
            self._arm(_HEADERS, self._timeouts.header_s)
        elif data and self._phase == _ACCEPTED:  # the accept's deadline runs on
            self._phase = _HEADERS
        count = self._request_count  # (aiohttp's count of parsed messages, refusals included)
        super().data_received(data)
        if self._phase == _BODY and self._request_count != count and not self._payload.is_eof():
            # The parser refused the rest of a body (a broken chunk): aiohttp queues the refusal as
            # the next request and leaves this body's read waiting. Fail the read now instead.
            self._payload.set_exception(web.RequestPayloadError("malformed chunked encoding"))

    def headers_in(self, payload: Any) -> None:
        """The request's headers are parsed (called as its request object is made): its body's deadline."""
        self._payload = payload
        if payload.is_eof():
            self._arm(_BUSY, None)
            return
        self._arm(_BODY, self._timeouts.body_s)
        payload.on_eof(self._body_in)

    def _body_in(self) -> None:
        if self._phase == _BODY:
            self._arm(_BUSY, None)
        elif self._phase == _DRAIN:  # aiohttp read the rest of a body nobody wanted: the connection is idle
            self._arm(_IDLE, self._timeouts.keep_alive_s)

    async def finish_response(self, request: web.BaseRequest, resp: web.StreamResponse,
                              start_time: float | None) -> tuple[web.StreamResponse, bool]:
        result = await super().finish_response(request, resp, start_time)
        payload = request.content
        if payload.exception() is not None or (request.get(CLOSE) and not payload.is_eof()):
            # The body failed (its bytes are no request), or the answer refused a body that was never
            # sent (413 or 417 to Expect): nothing more worth reading here.
            self.force_close()
        elif self.transport is not None:
            if payload.is_eof():
                self._arm(_IDLE, self._timeouts.keep_alive_s)
            else:  # a body the handler did not read: aiohttp drains it (for at most its lingering time)
                self._arm(_DRAIN, None)
        return result

    def _expired(self) -> None:
        self._timer = None
        phase, peer = self._phase, _peer(self.peername)
        if phase in (_ACCEPTED, _IDLE):  # nothing sent (yet again): closing needs no answer
            self.force_close()
        elif phase == _HEADERS:
            rid = uuid.uuid4().hex
            logger.warning("Reqid: %s, request headers from %s incomplete after %g s: 408, connection closed",
                           rid, peer, self._timeouts.header_s)
            body = json.dumps(error_body(f"the request headers were not complete within "
                                         f"{self._timeouts.header_s:g} s", "invalid_request_error", None,
                                         "request_timeout")).encode()
            if self.transport is not None:
                self.transport.write(b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\n"
                                     b"Connection: close\r\nX-Request-Id: %s\r\nContent-Length: %d\r\n\r\n%s"
                                     % (rid.encode(), len(body), body))
            self.force_close()
        elif phase == _BODY and self._payload is not None:
            self._payload.set_exception(BodyTimeout(
                f"the request body was not complete within {self._timeouts.body_s:g} s after its headers"))

    # ------------------------------------------------------------ what aiohttp answers itself
    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """A parser refusal (400), an exception that escaped the middleware (500) or a handler timeout
        (504), in OpenAI's shape; the connection closes after it, as aiohttp's own answer does."""
        if request.writer.output_size > 0:  # part of an answer went out already: only closing is left
            raise ConnectionError("cannot answer an error after the response started")
        rid = uuid.uuid4().hex
        if status < 500:
            reason = _refusal(exc, message)
            level = logging.DEBUG if isinstance(exc, BadHttpMethod) else logging.WARNING  # port scans: noise
            logger.log(level, "Reqid: %s, HTTP request from %s refused by the parser (%d): %s", rid,
                       _peer(self.peername), status, reason)
            resp = _json_response(status, reason, "invalid_http_request", rid)
        else:
            logger.error("Reqid: %s, %s %s failed outside the middleware (%d)", rid, request.method,
                         request.path, status, exc_info=exc)
            resp = _json_response(status, "internal server error" if status == 500 else "the handler timed out",
                                  "internal_error", rid)
        resp.force_close()
        return resp


def edge_request_factory(factory: Callable[..., web.BaseRequest]) -> Callable[..., web.BaseRequest]:
    """The app's request factory, telling EdgeProtocol when headers are in and keeping `Expect` from aiohttp."""
    def make(message: Any, payload: Any, protocol: web.RequestHandler, writer: Any, task: Any) -> web.BaseRequest:
        expect = message.headers.get(hdrs.EXPECT)
        if expect is not None:
            headers = CIMultiDict(message.headers)
            del headers[hdrs.EXPECT]
            message = message._replace(headers=CIMultiDictProxy(headers), raw_headers=tuple(
                (k, v) for k, v in message.raw_headers if k.lower() != b"expect"))
        request = factory(message, payload, protocol, writer, task)
        if expect is not None:  # until answered with 100 Continue the body never comes: any other
            request[EXPECT], request[CLOSE] = expect, True  # answer ends the connection
        if isinstance(protocol, EdgeProtocol):
            protocol.headers_in(payload)
        return request

    return make


async def listen(runner: web.AppRunner, sock: Any, timeouts: HttpTimeouts, **handler_args: Any) -> asyncio.Server:
    """Serve `runner`'s (set up) app on `sock` through EdgeProtocol; `handler_args` as for RequestHandler."""
    server = runner.server
    assert server is not None, "runner.setup() first"
    server.request_factory = edge_request_factory(server.request_factory)
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: EdgeProtocol(server, loop=loop, timeouts=timeouts, **handler_args),
                                    sock=sock)
