"""Pipelined GETs whose values land straight in caller buffers, on one of redis-py's pooled connections.

redis-py turns every bulk reply into a fresh `bytes` object, which the KV load then copies into
its staging buffer: an allocation (page faults for half-MiB values) and a copy per object, the
larger part of a load's cost here. `get_into` speaks just enough RESP to read the replies of a
pipeline of GETs itself: each value's bytes go from the socket into the caller's spans with
`recv_into`, and only the framing lines pass through a small buffer. The connection (TCP, TLS or
unix socket, authenticated) is redis-py's; a connection whose reply stream was left half read
is disconnected, never handed back to the pool.
"""
from __future__ import annotations

import socket
from typing import Any

import redis

_LINE_READ = 4096  # framing reads: one line and the start of the value that follows it


class _Replies:
    """A RESP reply stream: framing lines through a small buffer, bulk values read in place."""

    def __init__(self, sock: Any) -> None:
        self.sock = sock
        self.buf = bytearray()

    def _recv(self) -> None:
        chunk = self.sock.recv(_LINE_READ)
        if not chunk:
            raise redis.ConnectionError("redis closed the connection in the middle of a reply")
        self.buf += chunk

    def line(self) -> bytes:
        while (end := self.buf.find(b"\r\n")) < 0:
            self._recv()
        line = bytes(self.buf[:end])
        del self.buf[:end + 2]
        return line

    def into(self, view: memoryview) -> None:
        """Fill `view` with the next bytes of the stream."""
        done = min(len(self.buf), view.nbytes)
        view[:done] = self.buf[:done]
        del self.buf[:done]
        while done < view.nbytes:
            got = self.sock.recv_into(view[done:])
            if not got:
                raise redis.ConnectionError("redis closed the connection in the middle of a value")
            done += got

    def skip(self, nbytes: int) -> None:
        scratch = memoryview(bytearray(min(nbytes, 1 << 16)))
        while nbytes:
            step = min(nbytes, scratch.nbytes)
            self.into(scratch[:step])
            nbytes -= step


def get_into(client: redis.Redis, names: list[str], views: list[list[memoryview]]) -> list[int | None]:
    """GET every name in one pipelined round trip; a value of exactly the size of its views is read
    into them (in order), any other value is read past. Returns each value's size (None: no such
    key). A redis error reply raises redis.ResponseError after the whole stream was read; socket
    failures raise redis.ConnectionError / redis.TimeoutError (the connection is dropped)."""
    pool = client.connection_pool
    conn = pool.get_connection()
    clean = False
    try:
        conn.send_packed_command(conn.pack_commands([("GET", name) for name in names]))
        replies = _Replies(conn._sock)  # noqa: SLF001 (redis-py keeps the connected socket there)
        sizes: list[int | None] = []
        error = None
        for spans in views:
            head = replies.line()
            kind = head[:1]
            if kind == b"$" and head != b"$-1":
                size = int(head[1:])
                if size == sum(span.nbytes for span in spans):
                    for span in spans:
                        replies.into(span)
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
        clean = not replies.buf
        if error is not None:
            raise error
        return sizes
    except socket.timeout as exc:
        raise redis.TimeoutError(f"no reply within the socket timeout: {exc}") from exc
    except OSError as exc:
        raise redis.ConnectionError(f"reading replies: {exc}") from exc
    finally:
        if not clean:
            conn.disconnect()
        pool.release(conn)
