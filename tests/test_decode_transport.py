"""Generate over a decode node's HTTP port (serving/delta_frames.py) and over gRPC answer alike.

A prefill and two decode nodes with an API key behind two proxies: the default one streams over the nodes' HTTP
ports, the other keeps gRPC (--decode-transport grpc). The same requests through both give the same
bodies, errors included; a client that leaves aborts the node's request, and a killed node's streams
resume elsewhere over either transport. The frame endpoint itself refuses what is not a call.
"""
from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import pytest

from pdserve.protos import pdserve_pb2 as pb
from pdserve.proxy.health import Node
from pdserve.proxy.http_generate import HttpGenerate
from pdserve.serving import delta_frames as frames
from pdserve.serving import protocol as oai
from pdserve.serving import wire
from tests.cluster_helpers import MAX_MODEL_LEN, NODE_ARGS, extra_proxy, log_lines, status, wait_until
from tests.test_generate import hf_greedy, random_prompt

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

KEY = "node-secret"
PROMPT = random_prompt(40, seed=4242)


@pytest.fixture(scope="module")
def nodes(tiny_llama, tmp_path_factory):
    from pdserve.deploy.processes import ClusterSpec, LocalCluster

    c = LocalCluster(ClusterSpec(model=str(tiny_llama), log_dir=tmp_path_factory.mktemp("transport"), num_prefill=1,
                                 num_decode=2, node_args=[*NODE_ARGS, "--api-key", KEY],
                                 proxy_args=["--health-interval", "0.3", "--node-api-key", KEY]))
    c.start(timeout_s=180)
    c.grpc, c.grpc_url = extra_proxy(c, "proxy-grpc", "--decode-transport", "grpc", "--node-api-key", KEY)
    yield c
    c.grpc.stop()
    c.stop()


def _proxies(c) -> dict[str, str]:
    return {"http": c.url, "grpc": c.grpc_url}


def _post(url: str, body: dict, rid: str) -> tuple[int, dict | list[dict]]:
    """(status, body); a stream's body is its list of chunks (ids and timestamps dropped)."""
    r = httpx.post(url + "/v1/completions", json=body, headers={"X-Request-Id": rid}, timeout=120)
    if not body.get("stream"):
        out = r.json()
        out.pop("created", None)
        return r.status_code, out
    chunks = []
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            chunk = json.loads(line[6:])
            chunk.pop("created", None)
            chunks.append(chunk)
    return r.status_code, chunks


def _routes(nodes) -> dict[str, set[str]]:
    return {name: {n["generate_over"] for n in status(url)["decode"]} for name, url in _proxies(nodes).items()}


def _routes_meant(nodes) -> dict[str, set[str]]:
    return {"grpc": {"grpc"}, "http": {f"http://127.0.0.1:{n.http_port}" for n in nodes.decode}}


def test_each_proxy_uses_its_transport(nodes):
    assert _routes(nodes) == _routes_meant(nodes)


BODIES = {
    "greedy": {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "return_token_ids": True},
    "stream": {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stream": True,
               "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    "n2-seeded-logprobs": {"prompt": PROMPT, "max_tokens": 9, "n": 2, "seed": 7, "temperature": 0.8,
                           "logprobs": 2, "echo": True, "stream": True},
    "stop": {"prompt": PROMPT, "max_tokens": 30, "temperature": 0, "stop_token_ids": [5, 6, 7]},
    "node-rejects": {"prompt": PROMPT, "max_tokens": 4, "structured_outputs": {"regex": "(unclosed"}},
}


@pytest.mark.parametrize("case", sorted(BODIES))
def test_both_transports_give_the_same_answer(nodes, tiny_llama, case):
    got = {name: _post(url, BODIES[case], f"same-{case}") for name, url in _proxies(nodes).items()}
    assert got["http"] == got["grpc"]
    code, body = got["http"]
    if case == "node-rejects":  # only a node checks grammars: its 400 crosses either transport unchanged
        assert code == 400 and body["error"]["type"] == "invalid_request_error", body
    else:
        assert code == 200, body
    if case == "greedy":
        assert body["choices"][0]["token_ids"] == hf_greedy(tiny_llama, [PROMPT], 12)[0]


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_a_client_that_leaves_aborts_the_request_on_the_node(nodes, transport):
    rid = f"leaves-{transport}"
    body = {"prompt": PROMPT, "max_tokens": MAX_MODEL_LEN - len(PROMPT), "ignore_eos": True, "stream": True}
    with httpx.stream("POST", _proxies(nodes)[transport] + "/v1/completions", json=body,
                      headers={"X-Request-Id": rid}, timeout=60) as r:
        next(line for line in r.iter_lines() if line.startswith("data: {"))
    wait_until(lambda: any("aborted" in line for n in nodes.decode for line in log_lines(n.log_file, rid)),
               "the decode node to abort the request")


def _frames(response: httpx.Response) -> list[tuple[bytes, bytes]]:
    data, out, h = response.content, [], frames.HEADER_BYTES
    while data:
        kind, length = frames.parse_header(data[:h])
        out.append((kind, data[h:h + length]))
        data = data[h + length:]
    return out


def test_the_frame_endpoint_speaks_only_its_format(nodes, tiny_llama):
    url = f"http://127.0.0.1:{nodes.decode[0].http_port}{frames.PATH}"
    key = {"Authorization": f"Bearer {KEY}"}
    def params(**body) -> pb.SamplingParams:  # as the proxy fills them in
        return wire.sampling_to_pb(oai.parse_request(oai.COMPLETION, json.dumps({"prompt": PROMPT, **body}).encode(),
                                                     check_grammar=False))

    call = pb.GenerateRequest(request_id="frames", prompt=pb.Prompt(token_ids=pb.TokenIds(ids=PROMPT)),
                              params=params(max_tokens=5, temperature=0))
    typed = {"Content-Type": frames.REQUEST_TYPE}
    assert httpx.post(url, content=call.SerializeToString(), headers=typed, timeout=30).status_code == 401
    r = httpx.post(url, content=b"{}", headers={**key, "Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400 and "GenerateRequest" in r.json()["error"]["message"]
    r = httpx.post(url, content=b"\xff\xff\xff", headers={**key, **typed}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"

    r = httpx.post(url, content=call.SerializeToString(), headers={**key, **typed}, timeout=60)
    assert r.status_code == 200 and r.headers["Content-Type"] == frames.STREAM_TYPE
    assert all(kind == frames.DELTA for kind, _ in _frames(r)), _frames(r)
    deltas = [pb.GenerateDelta.FromString(p) for _, p in _frames(r) if p]
    assert [t for d in deltas for t in d.token_ids] == hf_greedy(tiny_llama, [PROMPT], 5)[0]
    assert deltas[-1].finish_reason and not any(d.finish_reason for d in deltas[:-1])

    too_long = pb.GenerateRequest(request_id="frames-bad", prompt=call.prompt,
                                  params=params(max_tokens=10**6))
    r = httpx.post(url, content=too_long.SerializeToString(), headers={**key, **typed}, timeout=60)
    (kind, payload), = _frames(r)
    failed = frames.CallFailed.from_frame(payload)
    assert kind == frames.ERROR and failed.code().name == "INVALID_ARGUMENT"
    assert json.loads(failed.details())["error"]["type"] == "invalid_request_error"


def test_a_port_that_does_not_answer_keeps_grpc(nodes):
    """A node whose HTTP port cannot be reached (a firewall, say) keeps Generate on gRPC; once the port
    answers, its streams move over."""
    from pdserve.deploy.processes import free_port

    async def check() -> tuple[str | None, str | None]:
        http = HttpGenerate(KEY, connect_s=1.0)
        http.start()
        node = Node(nodes.decode[0].grpc_address, "decode", http=http)
        try:
            await node._check_http(free_port(), timeout_s=1.0)  # nothing listens there
            closed = node.http_url
            await node._check_http(nodes.decode[0].http_port, timeout_s=1.0)
            return closed, node.http_url
        finally:
            await http.close()

    closed, opened = asyncio.run(check())
    assert closed is None
    assert opened == f"http://127.0.0.1:{nodes.decode[0].http_port}"


def _healthy(url: str, node) -> bool:
    return any(n["healthy"] for n in status(url)["decode"] if n["address"] == node.grpc_address)


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_a_killed_node_streams_resume_elsewhere(nodes, tiny_llama, transport):
    """SIGKILL the node a stream is on after a few tokens: the client's stream goes on, exact."""
    rid = f"killed-{transport}"
    # Long enough that the node is still decoding when the client has read 5 tokens (a tiny model
    # streams 60 tokens faster than a loaded test process reads them).
    body = {"prompt": PROMPT, "max_tokens": 600, "ignore_eos": True, "temperature": 0, "stream": True,
            "return_token_ids": True}
    code, whole = _post(nodes.url, {**body, "stream": False}, f"{rid}-reference")
    assert code == 200
    reference = whole["choices"][0]["token_ids"]
    assert len(reference) == 600
    tokens: list[int] = []
    killed = False
    with httpx.stream("POST", _proxies(nodes)[transport] + "/v1/completions", json=body,
                      headers={"X-Request-Id": rid}, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            tokens += json.loads(line[6:])["choices"][0].get("token_ids") or []
            if len(tokens) >= 5 and not killed:
                busy = {n["address"] for n in status(_proxies(nodes)[transport])["decode"] if n["in_flight"]}
                victim = next(n for n in nodes.decode if n.grpc_address in busy)
                victim.kill()
                killed = True
    assert killed
    assert tokens == reference
    proxy = {"http": nodes.proxy, "grpc": nodes.grpc}[transport]
    assert any("resuming on" in line for line in log_lines(proxy.out_path, rid))
    # Both proxies see it gone before it comes back (a proxy's status from before its next probe would
    # still say healthy), then both see it back: the next test finds two healthy nodes behind each.
    wait_until(lambda: not any(_healthy(url, victim) for url in _proxies(nodes).values()), "both proxies to see it gone")
    victim.start()
    wait_until(lambda: all(_healthy(url, victim) for url in _proxies(nodes).values()), "both proxies to see it back",
               timeout_s=120)
    # Out of rotation dropped the HTTP route; the probes that bring the node back check it again (its gRPC
    # port may answer a probe before its HTTP port does: then the next probe moves it over).
    wait_until(lambda: _routes(nodes) == _routes_meant(nodes), "both proxies to route Generate as configured")


async def _greedy_tokens(http: HttpGenerate, base: str, rid: str, max_tokens: int) -> list[int]:
    """One Generate call over the frame client, read to its finish (the connection goes back to the pool)."""
    params = wire.sampling_to_pb(oai.parse_request(oai.COMPLETION, json.dumps(
        {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}).encode(), check_grammar=False))
    call = http.call(base, rid, pb.GenerateRequest(request_id=rid, prompt=pb.Prompt(token_ids=pb.TokenIds(ids=PROMPT)),
                                                   params=params))
    tokens: list[int] = []
    while (delta := await call.read()) is not grpc.aio.EOF:
        tokens += delta.token_ids
        if delta.finish_reason:
            call.finish()
            break
    return tokens


def test_a_keep_alive_connection_the_node_closed_is_retried_on_a_fresh_one(nodes, tiny_llama):
    """The node restarts, closing the proxy's idle keep-alive connection, while the proxy's loop is busy: the
    connection still looks open when the next call takes it, and that call must go out again on a new
    connection, not fail as if the node had (UNAVAILABLE, taking it out of rotation)."""
    node = nodes.decode[1]
    base = f"http://127.0.0.1:{node.http_port}"

    async def scenario() -> tuple[list[int], list[int], int]:
        http = HttpGenerate(KEY, connect_s=5.0)
        http.start()
        try:
            first = await _greedy_tokens(http, base, "stale-before", 3)
            assert http.pool.num_idle(("127.0.0.1", node.http_port)) == 1  # kept for the next call
            node.stop()  # (blocking this loop: the node's FIN waits unread on the idle connection)
            wait_until(lambda: not any(_healthy(url, node) for url in _proxies(nodes).values()), "it to be gone")
            node.start()
            wait_until(lambda: all(_healthy(url, node) for url in _proxies(nodes).values()), "it to be back",
                       timeout_s=120)
            second = await _greedy_tokens(http, base, "stale-after", 3)
            return first, second, http.pool.stale_retries
        finally:
            await http.close()

    first, second, retries = asyncio.run(scenario())
    assert first == second == hf_greedy(tiny_llama, [PROMPT], 3)[0]
    assert retries == 1
    wait_until(lambda: _routes(nodes) == _routes_meant(nodes), "both proxies to route Generate as configured")
