"""A lean HTTP/1.1 keep-alive client for the decode nodes' frame stream (serving/delta_frames.py).

Why not aiohttp's ClientSession: the proxy's added latency is its own Python per request
(benchmarks/pd_vs_monolithic.py --latency-only), and a ClientSession request runs tracing hooks,
a cookie jar, header multidicts, a StreamReader and a connector's bookkeeping for every call. The
frame stream needs none of that: one POST, a status line, three headers that matter, and a chunked
body whose bytes are the frames. `Conn` is an asyncio Protocol that decodes the chunked transfer
straight from `data_received` into a body buffer the caller cuts frames from; `Pool` keeps each
node's idle connections for the next call.

A keep-alive connection can be closed by the node (it restarted, or shut down idle connections)
while the proxy still holds it as idle: when the FIN is still in flight as a call starts on it,
the call sees the connection end before any byte of an answer. `Pool.request` retries that once on
a fresh connection, since the node never saw the request; anything else that breaks is the node's
failure, as before.
"""
from __future__ import annotations

import asyncio
import socket
from typing import Callable

_IDLE_S = 15.0  # an idle connection older than this is closed rather than reused (aiohttp's client default)
_MAX_IDLE = 64  # idle connections kept per node; more are closed on release
_MAX_HEAD = 64 * 1024  # status line + headers; a longer head is not a node's answer
_PAUSE_BYTES = 256 * 1024  # undelivered body that stops reading from the node (a slow client) ...
_RESUME_BYTES = 64 * 1024  # ... until the caller has taken it down to this

# Body framing states of `Conn` (ints: compared in the hot loop).
_HEAD, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILER, _LENGTH, _UNTIL_CLOSE, _DONE = range(8)



def _take_through(raw: bytearray, end_mark: bytes, what: str) -> bytes | None:
    """The bytes before `end_mark`, removed from `raw` with it; None until it has arrived."""
    end = raw.find(end_mark)
    if end < 0:
        if len(raw) > _MAX_HEAD:
            raise ProtocolError(f"{what} too long")
        return None
    taken = bytes(raw[:end])
    del raw[:end + len(end_mark)]
    return taken

class ProtocolError(Exception):
    """The node's bytes are not an HTTP/1.1 answer this client understands."""


class ConnectionLost(Exception):
    """The connection ended before the answer did; `answered` says whether any byte of it arrived."""

    def __init__(self, reason: str, answered: bool) -> None:
        super().__init__(reason)
        self.answered = answered


class Conn(asyncio.Protocol):
    """One HTTP/1.1 connection: one request at a time, its answer decoded as it arrives."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.raw = bytearray()  # received, not yet decoded
        self.body = bytearray()  # decoded body bytes the caller has not taken yet
        self.state = _DONE
        self.status = 0  # the answer's status, 0 before its head
        self.reason = ""
        self.keep_alive = False
        self.remaining = 0  # bytes left of the current chunk (or of a Content-Length body)
        self.answered = False  # any byte of the current answer arrived
        self.lost: str | None = None  # why the connection ended, once it has
        self.idle_since = 0.0
        self.on_end: Callable[[], None] | None = None  # run once the answer is complete (a drained call)
        self.paused = False  # reading stopped until the caller catches up
        self._waiter: asyncio.Future | None = None

    # ------------------------------------------------------------ asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:  # every request leaves in one write; no reason to hold it back
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except (OSError, AttributeError):
                pass

    def data_received(self, data: bytes) -> None:
        self.answered = True
        self.raw += data
        try:
            self._decode()
        except (ProtocolError, ValueError) as e:
            self._fail(f"unreadable answer: {e}"[:300])
        self._wake()
        if len(self.body) > _PAUSE_BYTES and not self.paused and self.lost is None:
            self.paused = True
            self.transport.pause_reading()
        if self.state == _DONE and self.on_end is not None:
            on_end, self.on_end = self.on_end, None
            on_end()

    def eof_received(self) -> bool:
        if self.state == _UNTIL_CLOSE:  # a body without a length ends with the connection
            self.state = _DONE
            self.keep_alive = False
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        if self.lost is None:
            self.lost = type(exc).__name__ if exc else "closed by the node"  # (short: it ends up in client errors)
        self.keep_alive = False
        self._wake()
        if self.on_end is not None:
            self.on_end = None

    # ------------------------------------------------------------ the caller's side
    def send(self, data: bytes) -> None:
        """Start a request: `data` is its whole head and body."""
        self.raw.clear()
        self.body.clear()
        self.state, self.status, self.answered, self.keep_alive = _HEAD, 0, False, False
        self.transport.write(data)

    def taken(self) -> None:
        """The caller took bytes from `body`: read from the node again once little is left."""
        if self.paused and len(self.body) <= _RESUME_BYTES:
            self.resume()

    def resume(self) -> None:
        if self.paused:
            self.paused = False
            if not self.transport.is_closing():
                self.transport.resume_reading()

    def wait(self) -> asyncio.Future:
        """A future done at the next arrival (or loss); the caller checks state again after it."""
        self.resume()  # (a frame larger than the pause mark needs more than is buffered)
        self._waiter = fut = self.loop.create_future()
        return fut

    @property
    def ended(self) -> bool:
        """The current answer is complete."""
        return self.state == _DONE

    @property
    def reusable(self) -> bool:
        return self.state == _DONE and self.keep_alive and self.lost is None and not self.raw \
            and not self.transport.is_closing()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def check(self) -> None:
        """ConnectionLost if the connection ended before the answer did."""
        if self.lost is not None and self.state != _DONE:
            raise ConnectionLost(self.lost, self.answered)

    # ------------------------------------------------------------ decoding
    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, reason: str) -> None:
        self.lost = reason
        self.keep_alive = False
        self.transport.close()

    def _decode(self) -> None:
        raw = self.raw
        while raw:
            state = self.state
            if state == _CHUNK_DATA or state == _LENGTH:
                take = min(self.remaining, len(raw))
                self.body += raw[:take] if take < len(raw) else raw
                del raw[:take]
                self.remaining -= take
                if self.remaining:
                    return
                self.state = _CHUNK_END if state == _CHUNK_DATA else _DONE
            elif state == _CHUNK_SIZE or state == _TRAILER:
                line = _take_through(raw, b"\r\n", "chunk header")
                if line is None:
                    return
                if state == _TRAILER:
                    if not line:
                        self.state = _DONE
                    continue
                try:
                    self.remaining = int(line.split(b";", 1)[0], 16)
                except ValueError:
                    raise ProtocolError(f"bad chunk size {line[:40]!r}") from None
                self.state = _CHUNK_DATA if self.remaining else _TRAILER
            elif state == _CHUNK_END:
                if len(raw) < 2:
                    return
                if raw[:2] != b"\r\n":
                    raise ProtocolError("chunk not followed by CRLF")
                del raw[:2]
                self.state = _CHUNK_SIZE
            elif state == _HEAD:
                head = _take_through(raw, b"\r\n\r\n", "head")
                if head is None:
                    return
                self._head(head)
            elif state == _UNTIL_CLOSE:
                self.body += raw
                raw.clear()
            else:  # bytes after a complete answer: nothing this client asked for
                raise ProtocolError(f"{len(raw)} bytes after the end of the answer")

    def _head(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        version, _, rest = lines[0].partition(" ")
        code, _, self.reason = rest.partition(" ")
        if not version.startswith("HTTP/1.") or not code.isdigit():
            raise ProtocolError(f"bad status line {lines[0][:80]!r}")
        status = int(code)
        if 100 <= status < 200:  # an interim answer (never asked for): the real one follows
            return
        self.status = status
        length = chunked = None
        keep_alive = version == "HTTP/1.1"
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            if name == "transfer-encoding":
                chunked = value.strip().lower() == "chunked"
                if not chunked:
                    raise ProtocolError(f"transfer-encoding {value.strip()!r}")
            elif name == "content-length":
                length = int(value)
            elif name == "connection":
                keep_alive = value.strip().lower() == "keep-alive" if version == "HTTP/1.0" \
                    else value.strip().lower() != "close"
        self.keep_alive = keep_alive
        if chunked:
            self.state = _CHUNK_SIZE
        elif length is not None:
            self.remaining = length
            self.state = _LENGTH if length else _DONE
        else:
            self.state = _UNTIL_CLOSE
            self.keep_alive = False


class Pool:
    """Idle keep-alive connections per node ((host, port)); connections open on demand, unbounded."""

    def __init__(self, connect_s: float) -> None:
        self.connect_s = connect_s
        self.stale_retries = 0  # calls retried because their idle connection had been closed by the node
        self._idle: dict[tuple[str, int], list[Conn]] = {}
        self._closed = False

    async def connect(self, address: tuple[str, int]) -> Conn:
        """A new connection; OSError / TimeoutError when the node does not take it within connect_s."""
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_s):
            _, conn = await loop.create_connection(lambda: Conn(loop), *address)
        return conn

    def idle(self, address: tuple[str, int]) -> Conn | None:
        """The most recently used idle connection still open and young enough, else None."""
        conns = self._idle.get(address)
        if not conns:
            return None
        now = asyncio.get_running_loop().time()
        while conns:
            conn = conns.pop()
            if conn.lost is None and not conn.transport.is_closing() and now - conn.idle_since < _IDLE_S:
                return conn
            conn.close()
        return None

    async def request(self, address: tuple[str, int], data: bytes, taken: Callable[[Conn], None]) -> Conn:
        """Send `data` on an idle connection or a new one and return once the answer's head is in.

        `taken` learns the connection first, so a caller cancelled meanwhile can close it. A reused
        connection that ends before any byte of the answer had been closed by the node: the request
        goes once more on a fresh one. OSError / TimeoutError when connecting fails; ConnectionLost."""
        conn = self.idle(address)
        reused = conn is not None
        if conn is None:
            conn = await self.connect(address)
        while True:
            taken(conn)
            conn.send(data)
            while not conn.status:
                if conn.lost is not None:
                    if reused and not conn.answered:
                        break
                    raise ConnectionLost(conn.lost, conn.answered)
                await conn.wait()
            else:
                return conn
            self.stale_retries += 1
            reused = False
            conn = await self.connect(address)

    def num_idle(self, address: tuple[str, int]) -> int:
        return len(self._idle.get(address, ()))

    def release(self, address: tuple[str, int], conn: Conn) -> None:
        """Give back a connection whose answer is complete: kept for the next call if it can be."""
        if self._closed or not conn.reusable:
            conn.close()
            return
        conn.resume()  # an idle connection must still see the node close it
        conns = self._idle.setdefault(address, [])
        if len(conns) >= _MAX_IDLE:
            conns.pop(0).close()
        conn.idle_since = asyncio.get_running_loop().time()
        conns.append(conn)

    def close(self) -> None:
        self._closed = True
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()
