"""KV events and the proxy's global index, with real processes and a real redis-server: two
prefill nodes and a decode node publish their prefix caches' chunk keys (--kv-events); a kv-aware proxy
reading them sends a repeated prefix back to the node holding it with no Lookup call at all; a killed node's
entries go; a restarted node sends a snapshot; trimmed, forged and garbage events only change routes, and
every answer still equals HF greedy."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import redis

from pdserve.common.hashing import chunk_keys
from pdserve.deploy.processes import CHUNK_SIZE, HOST, NODE_ARGS, Child, NodeProcess, free_port, python_module, shared_cores_env
from pdserve.serving.kv_events import FIELD, STREAM
from tests.helpers.cluster import client, routed, wait_until
from tests.helpers.oracles import hf_greedy
from tests.helpers.prompts import random_prompt

pytestmark = pytest.mark.slow

MODEL = "tiny-llama0"
MAX_TOKENS = 6
PREFIXES = [random_prompt(200, seed=7000 + i) for i in range(4)]


def _node(name: str, role: str, f: SimpleNamespace, grpc_port: int = 0, http_port: int = 0) -> NodeProcess:
    node = NodeProcess(name, [], f.log_dir, shared_cores_env({}), role=role, http_port=http_port or free_port(),
                       grpc_port=grpc_port or free_port())
    node.argv = python_module(f"pdserve.{role}_node", "--model", str(f.model), "--kv-store", f.store, "--host", HOST,
                              "--port", str(node.http_port), "--grpc-port", str(node.grpc_port), "--log-file",
                              str(node.log_file), "--fleet-registry", f.redis, "--kv-events", f.redis, *NODE_ARGS)
    node.start()
    return node


@pytest.fixture(scope="module")
def f(tiny_llama, tmp_path_factory, redis_module):
    log_dir = tmp_path_factory.mktemp("kv-events")
    f = SimpleNamespace(log_dir=log_dir, redis=redis_module.url, model=tiny_llama, children=[],
                        store=(log_dir / "kvstore").resolve().as_uri())
    try:
        port = free_port()
        f.proxy = Child("proxy-kv", python_module("pdserve.proxy", "--host", HOST, "--port", str(port), "--policy",
                                                  "kv-aware", "--health-interval", "0.3", "--fleet-registry", f.redis,
                                                  "--kv-events", f.redis), log_dir, ports=[port])
        f.url = f"http://{HOST}:{port}"
        f.proxy.start()
        f.children.append(f.proxy)
        f.p0, f.p1 = _node("prefill0", "prefill", f), _node("prefill1", "prefill", f)
        f.decode = _node("decode0", "decode", f)
        f.children += [f.p0, f.p1, f.decode]
        want = {f.p0.grpc_address, f.p1.grpc_address, f.decode.grpc_address}
        wait_until(lambda: {n["address"] for n in (_fleet(f.url) or {}).get("nodes", []) if n["healthy"]} == want
                   and set(_index(f.url).get("nodes", {})) >= want, "three healthy nodes, each in the KV index")
        yield f
    finally:
        for child in f.children:
            child.stop()


def _fleet(url: str) -> dict | None:
    try:
        return httpx.get(url + "/fleet", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return None


def _index(url: str) -> dict:
    return (_fleet(url) or {}).get("kv_events") or {}


def _lookups(url: str) -> int:
    return sum(r["lookup_rpcs"] for r in _fleet(url)["routing"].values())


def _complete(f: SimpleNamespace, prompt: list[int], rid: str) -> tuple[list[int], str]:
    """The answer's token ids and the prefill node that served it."""
    before = routed(f.url)
    resp = client(f.url).completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                            extra_body={"return_token_ids": True},
                                            extra_headers={"X-Request-Id": rid})
    after = routed(f.url)
    served = [a for a in (f.p0.grpc_address, f.p1.grpc_address) if after.get(a, 0) > before.get(a, 0)]
    assert len(served) == 1, (before, after)
    return resp.choices[0].token_ids, served[0]


def _holders(url: str, node: str) -> int:
    return _index(url).get("nodes", {}).get(node, 0)


def test_a_repeated_prefix_returns_to_its_node_with_no_lookup(f):
    prompts = [p + [65, 66] for p in PREFIXES] + [p + [67, 68, 69] for p in PREFIXES]
    refs = hf_greedy(f.model, prompts, MAX_TOKENS)
    first: dict[int, str] = {}
    for i, prefix in enumerate(PREFIXES):
        ids, node = _complete(f, prompts[i], f"kve-first-{i}")
        assert ids == refs[i]
        first[i] = node
        # its chunks reach the index (the proxy's view, from the stream) before the repeat is routed
        chunks = len(prefix) // CHUNK_SIZE
        wait_until(lambda: _holders(f.url, node) >= chunks, f"{node}'s chunks of prefix {i} in the index")
    for i in range(len(PREFIXES)):
        ids, node = _complete(f, prompts[len(PREFIXES) + i], f"kve-again-{i}")
        assert ids == refs[len(PREFIXES) + i] and node == first[i], (i, node, first)
    assert _lookups(f.url) == 0


def test_dropped_forged_and_garbage_events_change_routes_not_answers(f):
    r = redis.Redis.from_url(f.redis)
    r.xtrim(STREAM, maxlen=0)  # every event so far gone: the proxy's index keeps what it read
    r.xadd(STREAM, {FIELD: "not json"})
    r.xadd(STREAM, {"other": "field"})
    fp, chunk = _node_params(f)
    prompt = random_prompt(200, seed=8000) + [70]
    keys = chunk_keys(fp, prompt, chunk)
    # prefill1 claims a prefix it never computed (a forged restart: its real entries go too)
    r.xadd(STREAM, {FIELD: json.dumps({"v": 1, "node": f.p1.grpc_address, "boot": "forged", "seq": 1, "fp": fp,
                                       "chunk": chunk, "events": [{"kind": "snapshot", "keys": keys[:3]}]})})
    wait_until(lambda: _index(f.url).get("malformed", 0) >= 2 and _holders(f.url, f.p1.grpc_address) == 3,
               "the proxy to read the forged and the garbage entries")
    ids, node = _complete(f, prompt, "kve-forged")
    assert node == f.p1.grpc_address  # the index's word, wrong as it is
    assert ids == hf_greedy(f.model, [prompt], MAX_TOKENS)[0]  # prefill1 recomputed it: the same answer
    r.close()


def _node_params(f: SimpleNamespace) -> tuple[str, int]:
    """The (fingerprint, chunk size) the nodes publish with: the fleet's announced fingerprint, NODE_ARGS' chunks."""
    return _fleet(f.url)["fingerprint"], CHUNK_SIZE


def test_a_killed_node_leaves_the_index_and_its_restart_sends_a_snapshot(f):
    address = f.p0.grpc_address
    f.p0.kill()
    wait_until(lambda: address not in _index(f.url).get("nodes", {}), "prefill0's entries out of the KV index")
    assert f"{address}: its" in Path(f.proxy.out_path).read_text()
    f.p0 = _node("prefill0-again", "prefill", f, grpc_port=f.p0.grpc_port, http_port=f.p0.http_port)
    f.children.append(f.p0)
    wait_until(lambda: address in _index(f.url).get("nodes", {}), "prefill0's snapshot in the KV index")
    assert _holders(f.url, address) == 0  # a new process: an empty prefix cache
    prompt = PREFIXES[0] + [71]
    ids, _ = _complete(f, prompt, "kve-after-restart")
    assert ids == hf_greedy(f.model, [prompt], MAX_TOKENS)[0]
    assert _lookups(f.url) == 0
