"""Parallel nodes behind pd-proxy: real prefill/decode node processes, each with its
rank processes, a real store.

- a prefill node of one layout hands off to a decode node of another, exactly;
- a decode node's rank SIGKILLed mid-stream: that node exits non-zero of itself, the proxy resumes the
  stream on the other decode node, the client sees one exact stream, and no rank process is left.
"""
from __future__ import annotations

import json
import os
import random
import signal

import httpx
import pytest

from pdserve.deploy.processes import NODE_ARGS
from pdserve.serving import LLM, SamplingParams
from tests.helpers.cluster import log_lines, wait_until
from tests.helpers.parallel import child_pids, wait_gone
from tests.helpers.timing import HANG_S

rng = random.Random(7)
PROMPT = [rng.randrange(3, 259) for _ in range(200)]


def reference(model, max_tokens: int) -> str:
    llm = LLM(str(model), dtype="float32", kv_cache_memory="32MiB")
    return llm.generate([PROMPT], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))[0] \
        .outputs[0].text


def cluster_with(model, tmp_path, store: str, prefill: list[str], decode: list[list[str]]):
    """A LocalCluster whose nodes get their own layout flags (ClusterSpec's node_args are every node's)."""
    from pdserve.deploy.processes import ClusterSpec, LocalCluster

    cluster = LocalCluster(ClusterSpec(model=str(model), log_dir=tmp_path / "logs", store=store, num_prefill=1,
                                       num_decode=len(decode), node_args=list(NODE_ARGS),
                                       proxy_args=["--health-interval", "0.3"]))
    cluster.prefill[0].argv += prefill
    for node, flags in zip(cluster.decode, decode):
        node.argv += flags
    cluster.start(timeout_s=180)
    return cluster


@pytest.mark.parametrize("store", ["file", "redis"])
@pytest.mark.parametrize("prefill, decode", [(["-tp", "2"], []), ([], ["-pp", "2"]), (["-pp", "2"], ["-tp", "2"])],
                         ids=["TP2->TP1", "TP1->PP2", "PP2->TP2"])
@pytest.mark.slow  # seconds: outside make test-quick
def test_pairs_through_the_proxy(tiny_llama, tmp_path, store, prefill, decode):
    want = reference(tiny_llama, 16)
    cluster = cluster_with(tiny_llama, tmp_path, store, prefill, [decode])
    try:
        r = httpx.post(cluster.url + "/v1/completions", timeout=60, headers={"X-Request-Id": "pair-1"}, json={
            "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
        lookup = [line for line in log_lines(cluster.decode[0].log_file, "pair-1") if "KV hit tokens" in line]
        assert len(lookup) == 1 and "need to load: 200" in lookup[0], lookup  # all 200: decode goes on from the first token
    finally:
        cluster.stop()


@pytest.mark.slow  # seconds: outside make test-quick
def test_a_decode_rank_killed_mid_stream_resumes_on_the_other_node(tiny_llama, tmp_path):
    max_tokens = 400
    want = reference(tiny_llama, max_tokens)
    cluster = cluster_with(tiny_llama, tmp_path, "file", [], [["-tp", "2"], ["-tp", "2"]])
    try:
        ranks = {node.name: child_pids(node.proc.pid) for node in cluster.decode}
        assert all(len(r) == 1 for r in ranks.values()), ranks
        text, victim = "", None
        with httpx.stream("POST", cluster.url + "/v1/completions", timeout=60, headers={"X-Request-Id": "kill-1"},
                          json={"prompt": PROMPT, "max_tokens": max_tokens,
                                "temperature": 0, "ignore_eos": True, "stream": True}) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                text += json.loads(line[6:])["choices"][0]["text"]
                if victim is None and len(text) > 20:  # tokens flow: kill a rank of the node serving them
                    victim = next(n for n in cluster.decode if log_lines(n.log_file, "kill-1"))
                    (rank1,) = ranks[victim.name]
                    os.kill(rank1, signal.SIGKILL)
        assert victim is not None and text == want
        # Only a node that lingers on without its rank fails here, not a slow machine: the stream above (and
        # so this wait's start) may come long after the kill.
        wait_until(lambda: victim.proc.poll() is not None, f"{victim.name} to exit of itself after losing a rank "
                   "(docs/parallelism.md: gone within a second or two)", HANG_S)
        assert victim.proc.returncode != 0
        assert "this server exits" in victim.log_file.read_text()
        assert "resuming on" in cluster.proxy.out_path.read_text()
        assert not wait_gone(ranks[victim.name])
    finally:
        cluster.stop()
    assert not wait_gone(set().union(*ranks.values()))
