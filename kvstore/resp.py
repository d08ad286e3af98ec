"""Pipelined GETs whose values land straight in caller buffers, on one of redis-py's pooled connections.

redis-py turns every bulk reply into a fresh `bytes` object (hiredis parses the framing, not that),
which the KV load then copies into its staging buffer: an allocation (page faults for large values)
and a copy per object. `get_into` speaks just enough RESP to read the replies of a pipeline of GETs
itself: each value's bytes go from the socket into the caller's spans with `recv_into`, and only
the framing lines pass through a small buffer. It is the load's path without the compiled receiver
(no C compiler, PDSERVE_KERNELS=torch) and on TLS; `get_table` hands a pipeline to the receiver
(kvstore/csrc/kv_recv.c). benchmarks/transports.py measures both against redis-py with hiredis on
SmolLM2's KV: a 2k- or 8k-token load takes redis-py 1.16x (a busy machine) to 1.45x (a quiet one) as
long as get_into, and 1.5-2.5x as long as the receiver (docs/benchmarks.md). The connection (TCP, TLS or unix socket, authenticated) is
redis-py's; a connection whose reply stream was left half read is disconnected, never handed back
to the pool.
"""
from __future__ import annotations

import contextlib
import errno
import os
import select
import socket
import ssl
from typing import Any, Iterator

import numpy as np
import redis

from pdserve.kvstore.gate import NO_GATE, LoadAbandoned, WriteGate
from pdserve.kvstore.spans import SpanReader, SpanTable, advance, copy_into

_LINE_READ = 4096  # framing reads: one line and the start of the value that follows it


class _Replies:
    """A RESP reply stream: framing lines through a small buffer, bulk values read in place.

    With a write gate (kvstore.gate) the socket is non-blocking for the stream's lifetime: every
    wait for redis is a poll outside the gate, every write into a value's spans a recv of bytes
    already received (or a copy from the framing buffer) inside it. TLS sockets, whose readiness
    a poll cannot see, read each gated value into scratch memory first and copy it in inside."""

    def __init__(self, sock: Any, gate: WriteGate = NO_GATE, timeout: float | None = None) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.tls = isinstance(sock, ssl.SSLSocket)
        self.polled = gate is not NO_GATE and not self.tls
        if self.polled:
            self.timeout_ms = -1 if timeout is None else max(1, int(timeout * 1000))
            self.poller = select.poll()
            self.poller.register(sock.fileno(), select.POLLIN)

    def _wait(self) -> None:
        """Until the socket has bytes to read (polled streams), at most the socket timeout."""
        if not self.poller.poll(self.timeout_ms):
            raise socket.timeout("timed out")

    def _recv(self) -> None:
        while True:
            try:
                chunk = self.sock.recv(_LINE_READ)
                break
            except BlockingIOError:  # polled streams only
                self._wait()
        if not chunk:
            raise redis.ConnectionError("redis closed the connection in the middle of a reply")
        self.buf += chunk

    def line(self) -> bytes:
        while (end := self.buf.find(b"\r\n")) < 0:
            self._recv()
        line = bytes(self.buf[:end])
        del self.buf[:end + 2]
        return line

    def fill(self, views: list[memoryview], gate: WriteGate = NO_GATE, nbytes: int | None = None) -> None:
        """Fill `views` (in order; `nbytes` in all, when the caller has it) with the next bytes of the
        stream, writing them only inside `gate`."""
        views = [view for view in views if view.nbytes]
        if nbytes is None:
            nbytes = sum(view.nbytes for view in views)
        if gate is not NO_GATE and not self.polled:  # TLS: wait for the bytes in our own memory first
            scratch = memoryview(bytearray(nbytes))
            self.fill([scratch])
            with gate.writing():
                copy_into(scratch, views)
            return
        if self.buf and views:  # the start of the value came with its framing line
            done = min(len(self.buf), nbytes)
            with gate.writing():
                copy_into(memoryview(self.buf)[:done], views)
            del self.buf[:done]
            views = advance(views, done)
        while views:
            if self.tls:  # no recvmsg on TLS sockets (and no gate here: see above)
                got = self.sock.recv_into(views[0])
            elif self.polled:
                gate.enter()
                try:  # what has arrived, straight into the spans (non-blocking)
                    got = self.sock.recvmsg_into(views)[0]
                except BlockingIOError:
                    got = -1
                finally:
                    gate.leave()
                if got < 0:
                    self._wait()
                    continue
            else:
                got = self.sock.recvmsg_into(views)[0]
            if not got:
                raise redis.ConnectionError("redis closed the connection in the middle of a value")
            views = advance(views, got)

    def skip(self, nbytes: int) -> None:
        scratch = memoryview(bytearray(min(nbytes, 1 << 16)))
        while nbytes:
            step = min(nbytes, scratch.nbytes)
            self.fill([scratch[:step]], NO_GATE, step)
            nbytes -= step



@contextlib.contextmanager
def _pooled(client: redis.Redis) -> Iterator[Any]:
    """One of the client's pooled connections, whose `clean` attribute the caller sets once it read the
    reply stream to its end: any other connection is disconnected, never handed back half read.
    Socket failures surface as redis.TimeoutError / redis.ConnectionError."""
    pool = client.connection_pool
    conn = pool.get_connection()
    conn.pd_clean = False
    try:
        yield conn
    except socket.timeout as exc:
        raise redis.TimeoutError(f"no reply within the socket timeout: {exc}") from exc
    except OSError as exc:
        raise redis.ConnectionError(f"reading replies: {exc}") from exc
    finally:
        if not conn.pd_clean:
            conn.disconnect()
        pool.release(conn)


def get_into(client: redis.Redis, names: list[str], views: list[list[memoryview]], gate: WriteGate = NO_GATE
             ) -> list[int | None]:
    """GET every name in one pipelined round trip; a value of exactly the size of its views is read
    into them (in order), any other value is read past. Returns each value's size (None: no such
    key). With a `gate` (the views are memory the caller may take back), the views are written only
    inside it (kvstore.gate); LoadAbandoned once it is closed.
    A redis error reply raises redis.ResponseError after the whole stream was read; socket failures
    raise redis.ConnectionError / redis.TimeoutError (the connection is dropped)."""
    with _pooled(client) as conn:
        conn.send_packed_command(conn.pack_commands([("GET", name) for name in names]))
        sock = conn._sock  # noqa: SLF001 (redis-py keeps the connected socket there)
        timeout = sock.gettimeout()
        replies = _Replies(sock, gate, timeout)
        try:
            if replies.polled:
                sock.settimeout(0.0)  # every wait is replies' own poll, bounded by the socket timeout
            sizes: list[int | None] = []
            error = None
            for spans in views:
                head = replies.line()
                kind = head[:1]
                if kind == b"$" and head != b"$-1":
                    size = int(head[1:])
                    if size == sum(span.nbytes for span in spans):
                        replies.fill(spans, gate, size)
                    else:
                        replies.skip(size)
                    replies.skip(2)  # the value's closing CRLF
                    sizes.append(size)
                elif kind == b"$" or kind == b"_":  # RESP2 / RESP3 null: no such key
                    sizes.append(None)
                elif kind == b"-":
                    error = error or redis.ResponseError(head[1:].decode(errors="replace"))
                    sizes.append(None)
                else:
                    raise redis.ConnectionError(f"unexpected reply to GET: {head[:40]!r}")
            conn.pd_clean = not replies.buf
        finally:
            sock.settimeout(timeout)
        if error is not None:
            raise error
        return sizes


def get_table(client: redis.Redis, names: list[str], table: SpanTable, headers: np.ndarray, gate: WriteGate,
              reader: SpanReader) -> tuple[list[int | None], list[int]] | None:
    """get_into for a layer's objects through the compiled receiver (kvstore/csrc/kv_recv.c), which
    sends the GETs as the replies come (a bounded window ahead, not all at once): object i's value lands
    in its header (at headers[object_format.HEADER_SIZE * i]) and its table spans, which are written only inside
    `gate`, and is hashed as it lands. Returns (sizes, digests): digests[i] is the xxh3 of header bytes
    [0, object_format.SUMMED) and the spans of an object read whole (sizes[i] == object_format.HEADER_SIZE + its spans'
    bytes).
    None on a TLS connection (its bytes are not the socket's): the caller reads with get_into."""
    with _pooled(client) as conn:
        sock = conn._sock  # noqa: SLF001
        if isinstance(sock, ssl.SSLSocket):
            conn.pd_clean = True  # nothing was sent
            return None
        timeout = sock.gettimeout()
        commands = [b"".join(conn.pack_command("GET", name)) for name in names]
        got = reader.resp_get(sock.fileno(), commands, table.desc, table.first, table.bases(), headers,
                              gate.native(reader.gate_close), -1 if timeout is None else max(1, int(timeout * 1000)))
        if got.abandoned:  # the gate closed while the replies were read
            raise LoadAbandoned("the load was abandoned; its destination is no longer written")
        if got.status == -errno.ETIMEDOUT:
            raise socket.timeout("timed out")
        if got.status == -errno.ECONNRESET:
            raise redis.ConnectionError("redis closed the connection in the middle of a reply")
        if got.status == -errno.EPROTO:
            raise redis.ConnectionError("unexpected reply to GET")
        if got.status:
            raise OSError(-got.status, os.strerror(-got.status))
        conn.pd_clean = got.extra == 0
        if got.error is not None:
            raise redis.ResponseError(got.error)
        return [size if size >= 0 else None for size in got.sizes.tolist()], got.digests.tolist()
