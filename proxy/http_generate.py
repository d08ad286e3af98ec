"""The proxy's client for Generate over decode nodes' HTTP ports (wire format: serving/delta_frames.py).

One keep-alive aiohttp session serves every node. A call reads like a grpc.aio stream to
proxy/decode_stream.py: `read()` returns the next GenerateDelta or grpc.aio.EOF and raises
CallFailed (which answers code() and details() like AioRpcError) where gRPC would fail the call.
A node that dies or is cut off mid-stream is UNAVAILABLE, as over gRPC, so deadlines, retries and
resumption are the same for both transports.
"""
from __future__ import annotations

import asyncio

import aiohttp
import grpc

from protos import pdserve_pb2 as pb
from serving import delta_frames as frames
from serving.auth import bearer
from serving.delta_frames import CallFailed

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


class HttpGenerate:
    """Opens Generate calls; `start()` inside the running loop, `close()` at shutdown."""

    def __init__(self, api_key: str | None, connect_s: float) -> None:
        self._headers = {"Content-Type": frames.REQUEST_TYPE}
        if api_key:
            self._headers["Authorization"] = bearer(api_key)
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_s)
        self._session: aiohttp.ClientSession | None = None

    def start(self) -> None:
        # No limit on connections: every stream in flight holds one (HTTP/1.1), idle ones are reused.
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=self._timeout,
                                              auto_decompress=False)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def reachable(self, base: str, timeout_s: float) -> bool:
        """Whether the node answers on its HTTP port (a firewall may let only gRPC through)."""
        try:
            async with self._session.get(base + "/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                return r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    def call(self, base: str, request_id: str, request: pb.GenerateRequest) -> "FrameCall":
        headers = {**self._headers, "X-Request-Id": request_id}
        return FrameCall(self._session, base + frames.PATH, headers, request.SerializeToString())


class FrameCall:
    """One Generate call; the request goes out with the first `read()`."""

    def __init__(self, session: aiohttp.ClientSession, url: str, headers: dict[str, str], body: bytes) -> None:
        self._session, self._url, self._headers, self._body = session, url, headers, body
        self._response: aiohttp.ClientResponse | None = None

    async def _open(self) -> aiohttp.ClientResponse:
        try:
            response = await self._session.post(self._url, data=self._body, headers=self._headers)
        except (aiohttp.ClientError, OSError) as e:
            raise CallFailed(grpc.StatusCode.UNAVAILABLE, f"cannot connect ({type(e).__name__}: {e})"[:300]) from None
        if response.status != 200:
            text = (await response.text(errors="replace"))[:2000]
            response.release()
            raise CallFailed(_STATUS_CODES.get(response.status, grpc.StatusCode.INTERNAL), text)
        self._response = response
        return response

    async def read(self) -> pb.GenerateDelta | object:
        """The next delta (an empty one is a heartbeat), grpc.aio.EOF at the end; CallFailed."""
        response = self._response or await self._open()
        try:
            kind, length = frames.parse_header(await response.content.readexactly(frames.HEADER_BYTES))
            payload = await response.content.readexactly(length) if length else b""
        except asyncio.IncompleteReadError as e:
            if not e.partial and response.content.at_eof():
                return grpc.aio.EOF
            raise CallFailed(grpc.StatusCode.UNAVAILABLE, "the stream broke off mid-frame") from None
        except (aiohttp.ClientError, OSError) as e:  # the node died or the network dropped the connection
            raise CallFailed(grpc.StatusCode.UNAVAILABLE, f"connection lost mid-stream ({type(e).__name__})") from None
        except ValueError as e:  # not our format
            raise CallFailed(grpc.StatusCode.INTERNAL, f"unreadable stream: {e}") from None
        if kind == frames.ERROR:
            raise CallFailed.from_frame(payload)
        return pb.GenerateDelta.FromString(payload)

    def cancel(self) -> None:
        """Leave the call: the connection closes, and the node aborts the request."""
        if self._response is not None:
            self._response.close()

    def finish(self) -> None:
        """Every choice has finished: give the connection back for the next call once its end is read."""
        response = self._response
        if response is None:
            return
        if response.content.at_eof():  # the usual case: the last frame and the end came in one write
            response.release()
        else:
            task = asyncio.get_running_loop().create_task(_drain(response))
            _draining.add(task)  # held until done: the loop keeps only a weak reference
            task.add_done_callback(_draining.discard)


_draining: set[asyncio.Task] = set()


async def _drain(response: aiohttp.ClientResponse) -> None:
    try:
        async with asyncio.timeout(_DRAIN_S):
            await response.read()
        response.release()
    except (aiohttp.ClientError, OSError, TimeoutError):
        response.close()
