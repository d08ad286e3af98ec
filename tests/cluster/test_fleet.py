"""A fleet that changes while it serves, with real processes and a real redis-server: two
proxies started with --fleet-registry and no node at all serve once a prefill and a decode node announce
themselves; a decode node started later joins both proxies and gets traffic; SIGTERM takes a node out at
once while its stream finishes; SIGKILL takes it out once its announcement expires; a node of another model
is refused; DNS finds nodes by name."""
from __future__ import annotations

import signal
import subprocess
import threading
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from pdserve.deploy.processes import HOST, NODE_ARGS, Child, NodeProcess, free_port, python_module, shared_cores_env
from tests.helpers.cluster import client, routed, wait_until

pytestmark = pytest.mark.slow

MODEL = "tiny-llama0"


def _node(name: str, role: str, model: Path, kv_store: str, registry: str, log_dir: Path, *extra: str) -> NodeProcess:
    node = NodeProcess(name, [], log_dir, shared_cores_env({}), role=role, http_port=free_port(), grpc_port=free_port())
    node.argv = python_module(f"pdserve.{role}_node", "--model", str(model), "--kv-store", kv_store, "--host", HOST,
                              "--port", str(node.http_port), "--grpc-port", str(node.grpc_port), "--log-file",
                              str(node.log_file), "--fleet-registry", registry, *NODE_ARGS, *extra)
    node.start()
    return node


def _proxy(name: str, log_dir: Path, *args: str) -> tuple[Child, str]:
    port = free_port()
    child = Child(name, python_module("pdserve.proxy", "--host", HOST, "--port", str(port), "--policy", "round-robin",
                                      "--health-interval", "0.3", *args), log_dir, ports=[port])
    child.start()
    return child, f"http://{HOST}:{port}"


def _fleet(url: str) -> dict | None:
    try:
        return httpx.get(url + "/fleet", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return None


def _members(url: str, healthy: bool = False) -> set[tuple[str, str]] | None:
    """(role, address) of the proxy's fleet (only the healthy ones: `healthy`); None while it does not answer."""
    fleet = _fleet(url)
    if fleet is None:
        return None
    return {(n["role"], n["address"]) for n in fleet["nodes"] if n["healthy"] or not healthy}


def _complete(url: str, rid: str, max_tokens: int = 4) -> str:
    resp = client(url).completions.create(model=MODEL, prompt="the fleet", max_tokens=max_tokens, temperature=0,
                                          extra_headers={"X-Request-Id": rid})
    return resp.choices[0].finish_reason


@pytest.fixture(scope="module")
def fleet(tiny_llama, tmp_path_factory, redis_module):
    log_dir, redis = tmp_path_factory.mktemp("fleet"), redis_module
    store = (log_dir / "kvstore").resolve().as_uri()
    f = SimpleNamespace(log_dir=log_dir, registry=redis.url, store=store, model=tiny_llama, children=[])
    try:
        (f.a, f.a_url), (f.b, f.b_url) = (_proxy(name, log_dir, "--fleet-registry", redis.url)
                                          for name in ("proxy-a", "proxy-b"))
        f.children += [f.a, f.b]
        f.prefill = _node("prefill0", "prefill", tiny_llama, store, redis.url, log_dir)
        f.decode = _node("decode0", "decode", tiny_llama, store, redis.url, log_dir)
        f.children += [f.prefill, f.decode]
        yield f
    finally:
        for child in f.children:
            child.stop()


def _both_see(f, want: set[tuple[str, str]], what: str, healthy: bool = False) -> None:
    """Both proxies list exactly `want` (several proxies over one registry see one fleet)."""
    wait_until(lambda: _members(f.a_url, healthy) == want and _members(f.b_url, healthy) == want, what)


def test_nodes_that_announce_themselves_serve(fleet):
    want = {("prefill", fleet.prefill.grpc_address), ("decode", fleet.decode.grpc_address)}
    _both_see(fleet, want, "both proxies to see the announced nodes healthy", healthy=True)
    assert _complete(fleet.a_url, "fleet-first") == "length"
    nodes = _fleet(fleet.a_url)["nodes"]
    assert {n["source"] for n in nodes} == {"redis"} and {n["model"] for n in nodes} == {MODEL}
    assert all(n["http_address"] and n["tensor_parallel_size"] == 1 for n in nodes)
    assert "joined the fleet: decode node found by redis" in fleet.a.out_path.read_text()


def test_a_node_started_later_joins_and_gets_traffic(fleet):
    fleet.late = _node("decode1", "decode", fleet.model, fleet.store, fleet.registry, fleet.log_dir,
                       "--shutdown-timeout", "120")  # its drain lasts as long as its stream (next test)
    fleet.children.append(fleet.late)
    want = {("prefill", fleet.prefill.grpc_address), ("decode", fleet.decode.grpc_address),
            ("decode", fleet.late.grpc_address)}
    _both_see(fleet, want, "decode1 in both proxies' fleet, healthy", healthy=True)
    before = routed(fleet.a_url).get(fleet.late.grpc_address, 0)
    for i in range(4):  # round-robin over two decode nodes
        assert _complete(fleet.a_url, f"fleet-late-{i}") == "length"
    assert routed(fleet.a_url)[fleet.late.grpc_address] > before


def test_sigterm_takes_a_node_out_at_once_and_its_stream_finishes(fleet):
    late = fleet.late
    first, result = threading.Event(), {}

    def stream() -> None:  # on the node itself: the drain must wait for it
        with httpx.stream("POST", late.http_url + "/v1/completions", timeout=120, json={
                "model": MODEL, "prompt": "drain", "max_tokens": 400, "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                first.set()
                result["last"] = line if line else result.get("last")
                if '"finish_reason":"length"' in line.replace(" ", ""):
                    result["finished"] = True

    thread = threading.Thread(target=stream)
    thread.start()
    assert first.wait(60), "the stream never started"
    late.proc.send_signal(signal.SIGTERM)
    want = {("prefill", fleet.prefill.grpc_address), ("decode", fleet.decode.grpc_address)}
    _both_see(fleet, want, "decode1 out of both proxies' fleet")
    thread.join(120)
    assert result.get("finished"), result  # the drain let it finish
    assert late.proc.wait(60) == 0
    for proxy in (fleet.a, fleet.b):
        lines = [ln for ln in proxy.out_path.read_text().splitlines() if f"{late.grpc_address} left the fleet" in ln]
        assert len(lines) == 1 and "draining (SIGTERM)" in lines[0], lines
    assert _complete(fleet.a_url, "fleet-after-drain") == "length"


def test_another_model_is_refused(fleet, tiny_qwen2):
    other = _node("decode-qwen", "decode", tiny_qwen2, fleet.store, fleet.registry, fleet.log_dir)
    fleet.children.append(other)

    def refused(url: str) -> bool:
        f = _fleet(url)
        return f is not None and [r["address"] for r in f["refused"]] == [other.grpc_address]
    wait_until(lambda: refused(fleet.a_url) and refused(fleet.b_url), "both proxies to refuse the other model")
    assert other.grpc_address not in {a for _, a in _members(fleet.a_url)}
    assert fleet.a.out_path.read_text().count(f"{other.grpc_address} refused") == 1
    other.stop()
    wait_until(lambda: not _fleet(fleet.a_url)["refused"], "the refused node to leave the list")


def test_dns_finds_nodes_by_name(fleet):
    dns, url = _proxy("proxy-dns", fleet.log_dir, "--prefill-dns", f"localhost:{fleet.prefill.grpc_port}",
                      "--decode-dns", f"localhost:{fleet.decode.grpc_port}")
    fleet.children.append(dns)
    want = {("prefill", fleet.prefill.grpc_address), ("decode", fleet.decode.grpc_address)}
    wait_until(lambda: _members(url, healthy=True) == want, "the DNS proxy's nodes healthy")
    assert {n["source"] for n in _fleet(url)["nodes"]} == {"dns"}
    assert _complete(url, "fleet-dns") == "length"
    dns.stop()


def test_sigkill_takes_a_node_out_once_its_announcement_expires(fleet):
    fleet.prefill.kill()
    want = {("decode", fleet.decode.grpc_address)}
    _both_see(fleet, want, "prefill0 out of both proxies' fleet")
    for proxy in (fleet.a, fleet.b):
        lines = [ln for ln in proxy.out_path.read_text().splitlines()
                 if f"{fleet.prefill.grpc_address} left the fleet" in ln]
        assert len(lines) == 1 and "expired" in lines[0], lines
    assert _complete(fleet.a_url, "fleet-no-prefill") == "length"  # the decode node prefills itself


@pytest.mark.parametrize("args, message", [
    (["--fleet-registry", "redis://127.0.0.1:1/0"], "fleet registry redis://127.0.0.1:1/0 unusable"),
    (["--fleet-registry", "redis://127.0.0.1:1/0", "--host", "0.0.0.0"], "needs --advertise-address"),
    (["--kv-events", "redis://127.0.0.1:1/0"], "KV events Redis redis://127.0.0.1:1/0 unusable"),
])
def test_a_node_that_cannot_announce_says_so_before_loading(tiny_llama, args, message):
    """One line and exit 1 before any weights load: a node no proxy can find must not look healthy."""
    out = subprocess.run(python_module("pdserve.decode_node", "--model", str(tiny_llama), "--port", "0",
                                       "--grpc-port", "0", *args), capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and message in out.stderr.strip().splitlines()[-1], out.stderr
