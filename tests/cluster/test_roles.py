"""Live role switching, with real processes and a real redis-server: two `--role auto`
nodes (one starting as prefill, one as decode) and one fixed decode node behind a proxy with a registry and SLOs.
Long prompts with one-token answers put prefill past its TTFT SLO: the planner moves the auto decode node to
prefill. Short prompts (prefilled by the decode nodes themselves) with long answers then put decode past its
ITL SLO: it moves an auto node back. Requests run all along; every answer equals HF greedy on the same weights
and none is lost.

The SLOs are far below anything measurable (0.0001 ms), so which role is "past its SLO" is decided by which
role measured anything in the planner's window, that is by the traffic's shape, never by this machine's speed.
"""
from __future__ import annotations

import random
import threading
from types import SimpleNamespace

import httpx
import pytest

from pdserve.deploy.processes import HOST, NODE_ARGS, Child, NodeProcess, free_port, python_module, shared_cores_env
from tests.helpers.cluster import client, wait_until
from tests.helpers.oracles import hf_greedy

pytestmark = pytest.mark.slow

MODEL = "tiny-llama0"
SHORT = 32  # --local-prefill-threshold: the short prompts skip the prefill nodes
LONG_TOKENS, SHORT_TOKENS = 1, 24


def _node(name: str, role: str, f: SimpleNamespace, *extra: str) -> NodeProcess:
    node = NodeProcess(name, [], f.log_dir, shared_cores_env({}), role=role, http_port=free_port(),
                       grpc_port=free_port())
    node.argv = python_module(f"pdserve.{role}_node", "--model", str(f.model), "--kv-store", f.store, "--host", HOST,
                              "--port", str(node.http_port), "--grpc-port", str(node.grpc_port), "--log-file",
                              str(node.log_file), "--fleet-registry", f.registry, *NODE_ARGS, *extra)
    node.start()
    return node


@pytest.fixture(scope="module")
def roles(tiny_llama, tmp_path_factory, redis_module):
    log_dir = tmp_path_factory.mktemp("roles")
    f = SimpleNamespace(log_dir=log_dir, registry=redis_module.url, store=(log_dir / "kvstore").resolve().as_uri(),
                        model=tiny_llama, children=[])
    rng = random.Random(37)
    f.long = [[rng.randrange(10, 250) for _ in range(300)] for _ in range(3)]
    f.short = [[rng.randrange(10, 250) for _ in range(8)] for _ in range(3)]
    f.expected = {tuple(p): o for p, o in zip(f.long, hf_greedy(tiny_llama, f.long, LONG_TOKENS))}
    f.expected.update({tuple(p): o for p, o in zip(f.short, hf_greedy(tiny_llama, f.short, SHORT_TOKENS))})
    try:
        port = free_port()
        f.proxy = Child("proxy", python_module(
            "pdserve.proxy", "--host", HOST, "--port", str(port), "--fleet-registry", f.registry, "--health-interval",
            "0.3", "--local-prefill-threshold", str(SHORT), "--slo-ttft-ms", "0.0001", "--slo-itl-ms", "0.0001",
            "--planner-interval", "0.5", "--planner-window", "2", "--planner-hysteresis", "2", "--planner-cooldown",
            "1", "--no-admission-control"), log_dir, ports=[port])
        f.proxy.start()
        f.url = f"http://{HOST}:{port}"
        f.children.append(f.proxy)
        f.auto0 = _node("auto0", "prefill", f, "--role", "auto")
        f.auto1 = _node("auto1", "decode", f, "--role", "auto")
        f.decode = _node("decode0", "decode", f)
        f.children += [f.auto0, f.auto1, f.decode]
        yield f
    finally:
        for child in f.children:
            child.stop()


def _get(url: str, path: str) -> dict | None:
    try:
        return httpx.get(url + path, timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return None


def _roles(url: str) -> dict[str, str]:
    """gRPC address -> role of every healthy member of the proxy's fleet."""
    fleet = _get(url, "/fleet") or {"nodes": []}
    return {n["address"]: n["role"] for n in fleet["nodes"] if n["healthy"]}


class Traffic:
    """Requests from two threads until stopped; every answer checked against HF greedy, every failure kept."""

    def __init__(self, f: SimpleNamespace, prompts: list[list[int]], max_tokens: int) -> None:
        self.f, self.prompts, self.max_tokens = f, prompts, max_tokens
        self.stop, self.done, self.wrong, self.failed = threading.Event(), 0, [], []
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(2)]

    def __enter__(self) -> "Traffic":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=300)

    def _run(self, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            prompt = self.prompts[(i + n) % len(self.prompts)]
            n += 1
            try:
                resp = client(self.f.url).completions.create(model=MODEL, prompt=prompt, max_tokens=self.max_tokens,
                                                             temperature=0, extra_body={"return_token_ids": True})
            except Exception as e:  # a lost request: the test fails on it
                self.failed.append(repr(e))
                continue
            got = resp.choices[0].token_ids
            if got != self.f.expected[tuple(prompt)]:
                self.wrong.append((prompt[:4], got, self.f.expected[tuple(prompt)]))
            self.done += 1


def test_long_prompts_then_long_answers_move_an_auto_node_and_back(roles):
    f = roles
    auto0, auto1, decode0 = f.auto0.grpc_address, f.auto1.grpc_address, f.decode.grpc_address
    wait_until(lambda: _roles(f.url) == {auto0: "prefill", auto1: "decode", decode0: "decode"},
               "the three nodes in the proxy's fleet, healthy")
    with Traffic(f, f.long, LONG_TOKENS) as long_prompts:
        wait_until(lambda: _roles(f.url).get(auto1) == "prefill", "the planner to move auto1 to prefill")
        wait_until(lambda: long_prompts.done >= 4, "requests to run on the new fleet")
    planner = _get(f.url, "/planner")
    switched = [d for d in planner["decisions"] if d["action"] == "switch"]
    assert any(d["switch"]["address"] == auto1 and d["switch"]["to_role"] == "prefill" for d in switched), planner
    assert "prefill past its TTFT SLO" in f.proxy.out_path.read_text()
    with Traffic(f, f.short, SHORT_TOKENS) as long_answers:
        wait_until(lambda: list(_roles(f.url).values()).count("decode") == 2,
                   "the planner to move an auto node back to decode")
        wait_until(lambda: long_answers.done >= 4, "requests to run on the new fleet")
    assert _roles(f.url)[decode0] == "decode" and list(_roles(f.url).values()).count("prefill") == 1
    for traffic in (long_prompts, long_answers):
        assert not traffic.failed and not traffic.wrong, (traffic.failed[:3], traffic.wrong[:3])
    assert _get(f.url, "/planner")["switches"] >= 2
    metrics = httpx.get(f.url + "/metrics", timeout=5).text
    assert 'pdserve_planner_desired_replicas{role="decode"}' in metrics
    assert "role switched from decode to prefill" in f.auto1.log_file.read_text()


def test_a_switched_node_finishes_its_stream_and_refuses_the_old_role(roles):
    """SetRole straight to an auto decode node while its Generate streams: the stream ends with HF's tokens, the
    reply says none was left running, and a new Generate there is refused (UNAVAILABLE: a proxy retries it)."""
    import grpc

    from pdserve.protos import pdserve_pb2 as pb
    from pdserve.protos import pdserve_pb2_grpc as pb_grpc

    f = roles
    now = _roles(f.url)
    node = next(n for n in (f.auto0, f.auto1) if now.get(n.grpc_address) == "decode")
    planner_switches = (_get(f.url, "/planner") or {}).get("switches", 0)
    prompt, max_tokens = f.short[1], 64
    expected = hf_greedy(f.model, [prompt], max_tokens)[0]
    call = pb.GenerateRequest(request_id="roles-drain", prompt=pb.Prompt(token_ids=pb.TokenIds(ids=prompt)),
                              params=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, top_p=1.0, top_k=-1))
    with grpc.insecure_channel(node.grpc_address) as channel:
        stub = pb_grpc.PDNodeStub(channel)
        stream = stub.Generate(call, timeout=300)
        got = list(next(d for d in stream if d.token_ids).token_ids)  # running: the switch must wait for it
        switching = threading.Thread(target=lambda: f.__dict__.update(
            reply=stub.SetRole(pb.SetRoleRequest(role="prefill", drain_timeout_s=300), timeout=300)))
        switching.start()
        for d in stream:
            got += d.token_ids
        switching.join(timeout=300)
        assert got == expected and f.reply.role == "prefill" and f.reply.still_running == 0
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(pb.GenerateRequest(request_id="roles-refused", prompt=call.prompt, params=call.params),
                               timeout=300))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    # The proxy's fleet follows the switch, unless its planner (still running, with this fixture's SLOs) moved the
    # node again first: then its own switch count says so
    wait_until(lambda: _roles(f.url).get(node.grpc_address) == "prefill"
               or (_get(f.url, "/planner") or {}).get("switches", 0) > planner_switches,
               "the proxy's fleet to follow the switch")
