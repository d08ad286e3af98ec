"""The proxy's client for Generate over decode nodes' HTTP ports (wire format: serving/delta_frames.py).

Calls ride proxy/frame_client.py's keep-alive connections (one per stream in flight, idle ones
reused). A call reads like a grpc.aio stream to proxy/decode_stream.py: `read()` returns the next
GenerateDelta or grpc.aio.EOF and raises CallFailed (which answers code() and details() like
AioRpcError) where gRPC would fail the call. A node that dies or is cut off mid-stream is
UNAVAILABLE, as over gRPC, so deadlines, retries and resumption are the same for both transports.
"""
from __future__ import annotations

import asyncio

import grpc

from pdserve.protos import pdserve_pb2 as pb
from pdserve.proxy.frame_client import Conn, ConnectionLost, Pool
from pdserve.serving import delta_frames as frames
from pdserve.serving.auth import bearer
from pdserve.serving.delta_frames import CallFailed

_DRAIN_S = 5.0  # how long a finished call may take to deliver its end before its connection is dropped

# The node's HTTP answer before any frame -> the status gRPC would have given the call.
_STATUS_CODES = {401: grpc.StatusCode.UNAUTHENTICATED, 404: grpc.StatusCode.UNIMPLEMENTED,
                 503: grpc.StatusCode.UNAVAILABLE}


def http_base(grpc_address: str, port: int) -> str:
    """http://host:port for the host of a node's gRPC address (IPv6 literals bracketed)."""
    host = grpc_address.rpartition(":")[0]
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


def _address(base: str) -> tuple[str, int]:
    """(host, port) of an http_base URL."""
    host, _, port = base.removeprefix("http://").rpartition(":")
    return host.strip("[]"), int(port)


class HttpGenerate:
    """Opens Generate calls; `start()` inside the running loop, `close()` at shutdown."""

    def __init__(self, api_key: str | None, connect_s: float) -> None:
        self._auth = f"Authorization: {bearer(api_key)}\r\n" if api_key else ""
        self.pool = Pool(connect_s)
        self._heads: dict[str, tuple[tuple[str, int], bytes]] = {}  # base -> (address, the head's fixed part)

    def start(self) -> None:
        """(Connections open on demand, inside the loop that uses them.)"""

    async def close(self) -> None:
        self.pool.close()

    def _node(self, base: str) -> tuple[tuple[str, int], bytes]:
        node = self._heads.get(base)
        if node is None:
            address = _address(base)
            host = base.removeprefix("http://")
            head = (f"POST {frames.PATH} HTTP/1.1\r\nHost: {host}\r\nContent-Type: {frames.REQUEST_TYPE}\r\n"
                    f"{self._auth}").encode()
            node = self._heads[base] = (address, head)
        return node

    async def reachable(self, base: str, timeout_s: float) -> bool:
        """Whether the node answers on its HTTP port (a firewall may let only gRPC through)."""
        address, _ = self._node(base)
        request = f"GET /health HTTP/1.1\r\nHost: {base.removeprefix('http://')}\r\n\r\n".encode()
        conns: list[Conn] = []
        try:
            async with asyncio.timeout(timeout_s):
                conn = await self.pool.request(address, request, conns.append)
                while not conn.ended:
                    conn.check()
                    await conn.wait()
            self.pool.release(address, conn)
            return conn.status == 200
        except (ConnectionLost, OSError, TimeoutError):
            for conn in conns:
                conn.close()
            return False

    def call(self, base: str, request_id: str, request: pb.GenerateRequest) -> "FrameCall":
        address, head = self._node(base)
        body = request.SerializeToString()
        data = b"".join((head, f"X-Request-Id: {request_id}\r\nContent-Length: {len(body)}\r\n\r\n".encode(), body))
        return FrameCall(self.pool, address, data)


class FrameCall:
    """One Generate call; the request goes out with the first `read()`."""

    __slots__ = ("_pool", "_address", "_data", "_conn", "_open_conn")

    def __init__(self, pool: Pool, address: tuple[str, int], data: bytes) -> None:
        self._pool, self._address, self._data = pool, address, data
        self._conn: Conn | None = None  # once the answer's head is in with 200
        self._open_conn: Conn | None = None  # the connection the request went out on

    def _taken(self, conn: Conn) -> None:
        if self._open_conn is not None and self._open_conn is not conn:
            self._open_conn.close()  # (a stale one being replaced)
        self._open_conn = conn

    async def _open(self) -> Conn:
        try:
            conn = await self._pool.request(self._address, self._data, self._taken)
        except ConnectionLost as e:
            raise CallFailed(grpc.StatusCode.UNAVAILABLE, f"connection lost before the answer ({e})"[:300]) from None
        except OSError as e:
            raise CallFailed(grpc.StatusCode.UNAVAILABLE, f"cannot connect ({type(e).__name__}: {e})"[:300]) from None
        except TimeoutError:  # connect_s, shorter than the read's own deadline
            raise CallFailed(grpc.StatusCode.UNAVAILABLE,
                             f"cannot connect within {self._pool.connect_s:g}s") from None
        if conn.status != 200:
            while not conn.ended and conn.lost is None:
                await conn.wait()
            text = bytes(conn.body[:2000]).decode(errors="replace") or f"{conn.status} {conn.reason}"
            self._pool.release(self._address, conn)
            self._open_conn = None
            raise CallFailed(_STATUS_CODES.get(conn.status, grpc.StatusCode.INTERNAL), text)
        self._conn = conn
        return conn

    async def read(self) -> pb.GenerateDelta | object:
        """The next delta (an empty one is a heartbeat), grpc.aio.EOF at the end; CallFailed."""
        conn = self._conn or await self._open()
        body = conn.body
        while True:
            if len(body) >= frames.HEADER_BYTES:
                try:
                    kind, length = frames.parse_header(bytes(body[:frames.HEADER_BYTES]))
                except ValueError as e:  # not our format
                    raise CallFailed(grpc.StatusCode.INTERNAL, f"unreadable stream: {e}") from None
                end = frames.HEADER_BYTES + length
                if len(body) >= end:
                    payload = bytes(body[frames.HEADER_BYTES:end])
                    del body[:end]
                    if conn.paused:
                        conn.taken()
                    if kind == frames.ERROR:
                        raise CallFailed.from_frame(payload)
                    return pb.GenerateDelta.FromString(payload)
            if conn.ended:
                if body:
                    raise CallFailed(grpc.StatusCode.UNAVAILABLE, "the stream broke off mid-frame")
                return grpc.aio.EOF
            if conn.lost is not None:  # the node died or the network dropped the connection
                raise CallFailed(grpc.StatusCode.UNAVAILABLE, f"connection lost mid-stream ({conn.lost})"[:300])
            await conn.wait()

    def cancel(self) -> None:
        """Leave the call: the connection closes, and the node aborts the request."""
        if self._open_conn is not None:
            self._open_conn.close()

    def finish(self) -> None:
        """Every choice has finished: give the connection back for the next call once its end is read."""
        conn = self._conn
        if conn is None:
            return
        if conn.ended:  # the usual case: the last frame and the end came in one write
            self._pool.release(self._address, conn)
            return
        conn.resume()  # its end may be behind frames nobody will read
        loop = asyncio.get_running_loop()
        timer = loop.call_later(_DRAIN_S, conn.close)

        def ended() -> None:
            timer.cancel()
            self._pool.release(self._address, conn)

        conn.on_end = ended
