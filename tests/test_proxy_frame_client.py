"""The proxy's lean HTTP/1.1 client (proxy/frame_client.py via proxy/http_generate.py) over real sockets.

A real decode node always answers alike (tests/test_decode_transport.py drives one); the byte
boundaries, chunk extensions, trailers, error bodies and broken connections that any HTTP/1.1 peer
may produce come from a scripted server here, so every decoding path runs against real TCP.
"""
from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.protos import pdserve_pb2 as pb
from pdserve.proxy.http_generate import HttpGenerate
from pdserve.serving import delta_frames as frames

pytestmark = pytest.mark.timeout(60)

DELTAS = [pb.GenerateDelta(token_ids=[5], text="a"), pb.GenerateDelta(),  # a heartbeat between
          pb.GenerateDelta(token_ids=[6, 7], text="bc", finish_reason="length")]
FRAMES = b"".join(frames.delta_frame(d) for d in DELTAS)


def chunked(body: bytes, sizes: list[int], extension: bytes = b"") -> bytes:
    """`body` as chunks of the given sizes (the rest in one), then the last chunk and a trailer."""
    out, i = [], 0
    for size in [*sizes, len(body)]:
        piece = body[i:i + size]
        i += len(piece)
        if piece:
            out.append(b"%x%s\r\n%s\r\n" % (len(piece), extension, piece))
    return b"".join(out) + b"0\r\nX-Trailer: 1\r\n\r\n"


OK_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/x-pdserve-frames\r\nTransfer-Encoding: chunked\r\n\r\n"


class Scripted:
    """A TCP server answering each request with the next scripted answer: (bytes, bytes per write, then close)."""

    def __init__(self, answers: list[tuple[bytes, int, bool]]) -> None:
        self.answers = answers
        self.requests: list[tuple[int, bytes, bytes]] = []  # (connection number, head, body)
        self.connections = 0
        self.answered = 0  # answers written out to the end

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        try:
            while self.answers:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                self.requests.append((number, head, await reader.readexactly(length)))
                answer, step, close = self.answers.pop(0)
                for i in range(0, len(answer), step):
                    writer.write(answer[i:i + step])
                    await writer.drain()
                    if step < len(answer):
                        await asyncio.sleep(0.002)  # separate segments: separate data_received calls
                self.answered += 1
                if close:
                    break
        except asyncio.IncompleteReadError:
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        self.server.close()
        await self.server.wait_closed()


async def read_all(http: HttpGenerate, base: str, rid: str) -> list[pb.GenerateDelta]:
    call = http.call(base, rid, pb.GenerateRequest(request_id=rid))
    out = []
    try:
        while (delta := await call.read()) is not grpc.aio.EOF:
            out.append(delta)
            if delta.finish_reason:
                call.finish()
                break
    except BaseException:
        call.cancel()
        raise
    return out


def run(answers: list[tuple[bytes, int, bool]], calls: int, api_key: str | None = None):
    """(per call: its deltas or the CallFailed it raised, the server, the client's stale retries)."""
    async def go():
        server = Scripted(answers)
        base = await server.start()
        http = HttpGenerate(api_key, connect_s=2.0)
        http.start()
        results = []
        try:
            for i in range(calls):
                try:
                    results.append(await asyncio.wait_for(read_all(http, base, f"r{i}"), 10))
                except frames.CallFailed as e:
                    results.append(e)
                while server.answered <= i and server.answers:  # (a call may finish before its answer's end)
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.05)  # lets the answer's end, or a close by the server, reach the client
            return results, server, http.pool.stale_retries
        finally:
            await http.close()
            await server.stop()
    return asyncio.run(go())


@pytest.mark.parametrize("step", [1, 7, 10_000])
def test_frames_are_decoded_across_any_segment_boundaries_and_the_connection_is_reused(step):
    body = chunked(FRAMES, [3, 9, 1], b";ext=1")  # chunk boundaries inside frame headers and payloads
    results, server, _ = run([(OK_HEAD + body, step, False), (OK_HEAD + chunked(FRAMES, []), step, False)], 2,
                             api_key="k")
    assert results == [DELTAS, DELTAS]
    assert [number for number, _, _ in server.requests] == [1, 1]  # the second call reused the connection
    head, body_sent = server.requests[0][1], server.requests[0][2]
    assert head.startswith(b"POST /v1/pd/generate HTTP/1.1\r\n")
    for line in (b"Authorization: Bearer k", b"X-Request-Id: r0", b"Content-Type: application/x-protobuf"):
        assert line in head.split(b"\r\n")
    assert pb.GenerateRequest.FromString(body_sent).request_id == "r0"


def test_a_stream_larger_than_the_read_ahead_arrives_whole():
    """Reading from the node pauses while much is undelivered (a slow client) and resumes as the caller
    takes it, including for one frame larger than the pause mark."""
    big = [pb.GenerateDelta(token_ids=[i], text=str(i) * 50_000) for i in range(1, 10)]
    big.append(pb.GenerateDelta(token_ids=[10], text="x" * 700_000, finish_reason="length"))
    results, _, _ = run([(OK_HEAD + chunked(b"".join(frames.delta_frame(d) for d in big), [70_000] * 20), 300_000,
                          False)], 1)
    assert results == [big]


def test_an_error_status_is_the_call_s_failure_with_the_node_s_words():
    text = b'{"error": "no key"}'
    answer = b"HTTP/1.1 401 Unauthorized\r\nContent-Length: %d\r\n\r\n%s" % (len(text), text)
    results, server, _ = run([(answer, 5, False), (OK_HEAD + chunked(FRAMES, []), 10_000, False)], 2)
    assert isinstance(results[0], frames.CallFailed)
    assert results[0].code() == grpc.StatusCode.UNAUTHENTICATED and results[0].details() == text.decode()
    assert results[1] == DELTAS and [n for n, _, _ in server.requests] == [1, 1]


def test_an_error_frame_is_the_call_s_failure():
    body = chunked(frames.delta_frame(DELTAS[0]) + frames.error_frame(grpc.StatusCode.INVALID_ARGUMENT, "bad"), [])
    results, _, _ = run([(OK_HEAD + body, 10_000, False)], 1)
    assert isinstance(results[0], frames.CallFailed)
    assert (results[0].code(), results[0].details()) == (grpc.StatusCode.INVALID_ARGUMENT, "bad")


def test_a_stream_cut_mid_frame_is_unavailable():
    body = chunked(FRAMES, [])[:-30]  # the last frame's tail, the last chunk and the trailer never come
    results, _, _ = run([(OK_HEAD + body, 10_000, True)], 1)
    assert isinstance(results[0], frames.CallFailed) and results[0].code() == grpc.StatusCode.UNAVAILABLE


def test_an_answer_that_closes_its_connection_is_not_reused():
    close_head = OK_HEAD.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")
    results, server, retries = run([(close_head + chunked(FRAMES, []), 10_000, True),
                                    (OK_HEAD + chunked(FRAMES, []), 10_000, False)], 2)
    assert results == [DELTAS, DELTAS]
    assert [n for n, _, _ in server.requests] == [1, 2] and retries == 0


def test_a_node_that_closes_an_idle_connection_it_was_seen_to_close_costs_no_retry():
    """The ordinary case of a node closing idle connections: the close arrived while the connection was idle."""
    results, server, retries = run([(OK_HEAD + chunked(FRAMES, []), 10_000, True),
                                    (OK_HEAD + chunked(FRAMES, []), 10_000, False)], 2)
    assert results == [DELTAS, DELTAS] and [n for n, _, _ in server.requests] == [1, 2] and retries == 0


def test_nothing_listening_is_unavailable():
    async def go() -> frames.CallFailed:
        server = Scripted([])
        base = await server.start()
        await server.stop()  # the port is closed now
        http = HttpGenerate(None, connect_s=2.0)
        try:
            with pytest.raises(frames.CallFailed) as e:
                await read_all(http, base, "r")
            return e.value
        finally:
            await http.close()

    failed = asyncio.run(go())
    assert failed.code() == grpc.StatusCode.UNAVAILABLE and "cannot connect" in failed.details()
