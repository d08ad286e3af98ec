"""Smooth streams: one SSE chunk per engine step and choice for a client that keeps up; deltas merged
only for a client that falls behind.

The tiny test model's tokens are bytes, and about half of its greedy steps yield no text yet (half
of a UTF-8 character). Those steps still reach the client as chunks, as vLLM streams them: skipping
them made tokens arrive 2-3 at a time (vLLM's bench client: ITL mean 2.6x TPOT mean through the
proxy). Checked end to end through pd-serve and pd-proxy, and the SSE writer's merging on a real
aiohttp server whose client stops reading.
"""
from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest
from aiohttp import web

from pdserve.deploy.server_process import ServerProcess
from pdserve.serving.protocol import COMPLETION, parse_request
from pdserve.serving.responses import Delta, ResponseBuilder
from pdserve.serving.sse import SSEStream
from tests.helpers.cluster import start_cluster
from tests.helpers.serve import sse_events
from tests.helpers.timing import HANG_S


@pytest.fixture(scope="module")
def serve(tiny_llama):
    with ServerProcess("--model", str(tiny_llama), "--kv-cache-memory", "16MiB", "--dtype", "float32") as srv:
        yield srv.url


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory):
    c = start_cluster(tiny_llama, tmp_path_factory.mktemp("smooth"))
    yield c.url
    c.stop()


@pytest.fixture(params=["pd-serve", "proxy"])
def url(request) -> str:
    return request.getfixturevalue("serve" if request.param == "pd-serve" else "cluster")


def stream(url: str, path: str, body: dict) -> list:
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return sse_events(line.encode() for line in r.iter_lines())


@pytest.mark.slow  # seconds: outside make test-quick
def test_a_completion_stream_has_one_chunk_per_token(url):
    body = {"prompt": [5, 6, 7, 8, 9], "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    events = stream(url, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    usage = events[-2]["usage"]
    assert usage["completion_tokens"] == 48 and len(chunks) == 48
    texts = [c["choices"][0]["text"] for c in chunks]
    assert "" in texts  # steps whose byte completes no character yet: the case that used to be skipped
    whole = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
    assert "".join(texts) == whole["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.slow  # seconds: outside make test-quick
def test_each_chat_choice_has_one_chunk_per_token(url):
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 24, "n": 2, "temperature": 1.0,
            "seed": 3, "ignore_eos": True}
    events = stream(url, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 48
    for index in (0, 1):
        chunks = [e["choices"][0] for e in events[:-2] if e["choices"][0]["index"] == index]
        assert chunks[0]["delta"].get("role") == "assistant"  # each choice opens with its role chunk ...
        assert len(chunks) == 1 + 24  # ... then one chunk per token, text or not
        assert chunks[-1]["finish_reason"] == "length"


# ---------------------------------------------------------------- the SSE writer and a client that falls behind

NUM_DELTAS = 300


async def _sse(request: web.Request) -> web.StreamResponse:
    """NUM_DELTAS one-token deltas a millisecond apart, as an engine step would send them."""
    if request.query.get("slow"):  # small kernel buffers: a client that stops reading is felt at once
        request.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    req = parse_request(COMPLETION, json.dumps({"prompt": "x", "stream": True, "return_token_ids": True}),
                        check_grammar=False)
    sse = SSEStream(ResponseBuilder(req, "smooth", "m"))
    await sse.start(request, "smooth")
    for k in range(NUM_DELTAS):
        await sse.delta(Delta("" if k % 2 else "a longer piece of text " * 4, token_ids=[k]))
        await asyncio.sleep(0.001)
    if request.query.get("slow"):
        request.app[ISSUED].set()
    await sse.delta(Delta("", finish_reason="length"))
    request.app[MERGED].append(sse.num_merged)
    return await sse.finish(None)


MERGED = web.AppKey("merged", list)
ISSUED = web.AppKey("issued", asyncio.Event)  # the slow client's stream has issued every delta


async def _read(port: int, issued: asyncio.Event | None = None) -> list:
    """The stream's events over HTTP/1.0 (no chunked framing). A slow client (`issued` given) reads nothing
    until the server has issued every delta: however long that takes on this machine, what did not fit
    in the kernel's buffers meanwhile waits, merged."""
    slow = issued is not None
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    if slow:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    await loop.sock_sendall(sock, b"GET /sse%s HTTP/1.0\r\n\r\n" % (b"?slow=1" if slow else b""))
    if slow:
        await asyncio.wait_for(issued.wait(), HANG_S)
    data = b""
    while chunk := await loop.sock_recv(sock, 65536):
        data += chunk
    sock.close()
    return sse_events(data.partition(b"\r\n\r\n")[2].split(b"\n"))


async def _both_clients() -> tuple[list, list, list]:
    app = web.Application()
    app[MERGED] = []
    app[ISSUED] = asyncio.Event()
    app.router.add_get("/sse", _sse)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    try:
        fast = await _read(port)
        slow = await _read(port, app[ISSUED])
    finally:
        await runner.cleanup()
    return fast, slow, app[MERGED]


@pytest.mark.slow  # seconds: outside make test-quick
def test_the_sse_writer_merges_deltas_only_for_a_client_that_falls_behind():
    fast, slow, merged = asyncio.run(_both_clients())
    for events in (fast, slow):
        assert events[-1] == "[DONE]"
        ids = [t for e in events[:-1] for t in e["choices"][0]["token_ids"]]
        assert ids == list(range(NUM_DELTAS))  # every token, in order, whatever the pace
        assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert len(fast) == NUM_DELTAS + 2 and merged[0] == 0  # a chunk per delta, the finish, [DONE]
    assert len(slow) < NUM_DELTAS / 2 and merged[1] > NUM_DELTAS / 2, (len(slow), merged)
