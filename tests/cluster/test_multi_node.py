"""Two prefill and two decode nodes behind three proxies (least-loaded, round-robin, kv-aware): 64
concurrent requests with shared prefixes come out exactly as HF generates them; kv-aware sends repeated
prefixes back to where their KV is; a decode node killed mid-run fails only its own in-flight requests;
with every prefill node dead the decode node prefills locally; restarted nodes rejoin the rotation."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.helpers.cluster import client, extra_proxy, log_lines, routed, start_cluster, status, wait_until
from tests.helpers.oracles import hf_greedy
from tests.helpers.prompts import random_prompt

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
PREFIXES = [random_prompt(160, seed=900 + i) for i in range(8)]
PROMPTS = [p + random_prompt(4 + j, seed=1000 + 10 * i + j) for i, p in enumerate(PREFIXES) for j in range(8)]
MODEL = "tiny-llama0"  # the served name: the checkpoint directory's name (checked in the cluster fixture)


@pytest.fixture(scope="module")
def refs(tiny_llama):
    return hf_greedy(tiny_llama, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory):
    c = start_cluster(tiny_llama, tmp_path_factory.mktemp("cluster-2p2d"), num_prefill=2, num_decode=2)
    # round-robin with slow health checks: it only learns of a dead node from a failed call
    c.rr, c.rr_url = extra_proxy(c, "proxy-rr", "--policy", "round-robin", "--health-interval", "30")
    c.kv, c.kv_url = extra_proxy(c, "proxy-kv", "--policy", "kv-aware", "--api-key", "secret",
                                 "--local-prefill-threshold", "20")
    assert httpx.get(c.url + "/v1/models", timeout=5).json()["data"][0]["id"] == MODEL
    yield c
    c.rr.stop()
    c.kv.stop()
    c.stop()


def _complete(url: str, prompt: list[int], rid: str, api_key: str = "unused") -> list[int]:
    resp = client(url, api_key).completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                   extra_body={"return_token_ids": True},
                                                   extra_headers={"X-Request-Id": rid})
    return resp.choices[0].token_ids


def _run_all(url: str, indices: list[int], tag: str, api_key: str = "unused") -> list[list[int]]:
    with ThreadPoolExecutor(len(indices)) as pool:
        return list(pool.map(lambda i: _complete(url, PROMPTS[i], f"{tag}-{i}", api_key), indices))


def _diff(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {a: after[a] - before[a] for a in after}


def test_64_concurrent_requests_least_loaded(cluster, refs):
    before = routed(cluster.url)
    assert _run_all(cluster.url, list(range(64)), "ll") == refs
    sent = _diff(routed(cluster.url), before)
    assert all(sent[n.grpc_address] > 0 for n in cluster.prefill + cluster.decode), sent  # load was spread


def test_round_robin_alternates(cluster, refs):
    before = routed(cluster.rr_url)
    picks = list(range(0, 64, 4))
    assert _run_all(cluster.rr_url, picks, "rr") == [refs[i] for i in picks]
    sent = _diff(routed(cluster.rr_url), before)
    assert all(sent[n.grpc_address] == 8 for n in cluster.prefill + cluster.decode), sent


def test_kv_aware_sends_repeated_prefixes_where_their_kv_is(cluster, refs):
    assert _run_all(cluster.kv_url, list(range(1, 64, 4)), "kv", api_key="secret") == [refs[i] for i in
                                                                                        range(1, 64, 4)]
    for i in range(4):  # new prefixes, then the same prefix with another suffix: same nodes both times
        prefix = random_prompt(200, seed=5000 + i)
        first_before = routed(cluster.kv_url)
        _complete(cluster.kv_url, prefix + [65, 66], f"kv-first-{i}", "secret")
        first = {a for a, n in _diff(routed(cluster.kv_url), first_before).items() if n}
        again_before = routed(cluster.kv_url)
        _complete(cluster.kv_url, prefix + [67, 68, 69], f"kv-again-{i}", "secret")
        again = {a for a, n in _diff(routed(cluster.kv_url), again_before).items() if n}
        assert first == again and len(first) == 2, (first, again)
    with pytest.raises(openai.AuthenticationError):
        _complete(cluster.kv_url, PROMPTS[0], "kv-nokey", "wrong")


def test_short_prompts_skip_the_prefill_node(cluster, tiny_llama):
    short = random_prompt(12, seed=77)
    assert _complete(cluster.kv_url, short, "kv-short", "secret") == hf_greedy(tiny_llama, [short], MAX_TOKENS)[0]
    assert any("short prompt: decode node prefills locally" in line
               for line in log_lines(cluster.kv.out_path, "kv-short"))
    assert not any(log_lines(n.log_file, "kv-short") for n in cluster.prefill)


def test_client_disconnect_aborts_on_the_decode_node(cluster):
    body = {"model": MODEL, "prompt": PROMPTS[9], "max_tokens": 800, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", cluster.url + "/v1/completions", json=body, headers={"X-Request-Id": "gone"},
                      timeout=60) as r:
        next(line for line in r.iter_lines() if line.startswith("data: {"))
    wait_until(lambda: any("aborted" in line for n in cluster.decode for line in log_lines(n.log_file, "gone")),
               "the decode node to abort the request")


def _stream_outcome(url: str, rid: str, prompt: list[int], started) -> str:
    """'done' (finished normally) or 'error' (an in-band OpenAI error), read from the raw SSE stream."""
    body = {"prompt": prompt, "max_tokens": 300, "ignore_eos": True, "temperature": 0, "stream": True}
    outcome = "none"
    with httpx.stream("POST", url + "/v1/completions", json=body, headers={"X-Request-Id": rid}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            started.add(rid)
            if line == "data: [DONE]":
                return outcome
            event = json.loads(line[6:])
            if "error" in event:
                assert event["error"]["code"] == "decode_node_failed" and event["error"]["message"]
                outcome = "error"
            elif event["choices"][0]["finish_reason"] == "length":
                outcome = "done"
    return "no [DONE]"


def test_decode_node_killed_mid_run(cluster, refs):
    started: set[str] = set()
    victim, survivor = cluster.decode[1], cluster.decode[0]
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(_stream_outcome, cluster.url, f"kill-{i}", PROMPTS[8 * i], started) for i in range(6)]
        wait_until(lambda: len(started) == 6, "every stream's first chunk")
        in_flight = {n["address"]: n["in_flight"] for n in status(cluster.url)["decode"]}
        assert in_flight[victim.grpc_address] > 0 and in_flight[survivor.grpc_address] > 0, in_flight
        victim.kill()
        outcomes = [f.result(timeout=120) for f in futures]
    # the victim's streams resume on the survivor: every client sees one stream that finishes
    assert outcomes == ["done"] * 6, outcomes
    assert "resuming on " + survivor.grpc_address in cluster.proxy.out_path.read_text()
    wait_until(lambda: not {n["address"]: n["healthy"] for n in status(cluster.url)["decode"]}[victim.grpc_address],
               "the dead decode node out of rotation")
    before = routed(cluster.url)
    assert _run_all(cluster.url, list(range(2, 64, 8)), "after-kill") == [refs[i] for i in range(2, 64, 8)]
    sent = _diff(routed(cluster.url), before)
    assert sent[victim.grpc_address] == 0 and sent[survivor.grpc_address] == 8


def test_failed_prefill_is_retried_then_decode_prefills_locally(cluster, refs):
    cluster.prefill[0].kill()
    # the round-robin proxy has not noticed: one of two requests tries the dead node first, then the other
    assert [_complete(cluster.rr_url, PROMPTS[i], f"retry-{i}") for i in (3, 4)] == [refs[3], refs[4]]
    rr_log = cluster.rr.out_path.read_text()
    assert f"prefill on {cluster.prefill[0].grpc_address} failed" in rr_log and "trying the next node" in rr_log
    cluster.prefill[1].kill()
    wait_until(lambda: not any(n["healthy"] for n in status(cluster.url)["prefill"]), "no healthy prefill node")
    assert _run_all(cluster.url, [5, 13, 21], "local") == [refs[5], refs[13], refs[21]]
    for i in (5, 13, 21):
        assert any("decode node prefills locally" in line for line in log_lines(cluster.proxy.out_path, f"local-{i}"))
    # a text prompt is tokenized by the decode node itself (it never is when a prefill node ran)
    text = client(cluster.url).completions.create(model=MODEL, prompt="local " * 30, max_tokens=4, temperature=0,
                                                  extra_headers={"X-Request-Id": "local-text"})
    assert text.usage.prompt_tokens == 180
    assert any("local prefill: prompt tokenized here" in line for n in cluster.decode if n.alive
               for line in log_lines(n.log_file, "local-text"))


def test_restarted_nodes_rejoin_the_rotation(cluster, refs):
    restarted = [cluster.prefill[0], cluster.decode[1]]
    for node in restarted:
        node.start()
    cluster.wait_healthy(1, 2, timeout_s=120)
    before = routed(cluster.url)
    picks = list(range(6, 64, 4))
    assert _run_all(cluster.url, picks, "rejoin") == [refs[i] for i in picks]
    sent = _diff(routed(cluster.url), before)
    assert all(sent[n.grpc_address] > 0 for n in restarted), sent


def test_no_healthy_decode_node_is_503(cluster):
    for node in cluster.decode:
        node.kill()
    wait_until(lambda: not any(n["healthy"] for n in status(cluster.url)["decode"]), "no healthy decode node")
    r = httpx.post(cluster.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_decode_node"
    assert r.json()["error"]["type"] == "service_unavailable_error"
    assert httpx.get(cluster.url + "/health", timeout=5).status_code == 503
