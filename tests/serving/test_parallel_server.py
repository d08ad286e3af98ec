"""-tp / -pp on the servers (issue 28 step 3): a real pd-serve with its rank processes, and its supervision.

A server that loses a rank cannot answer any more: it exits non-zero at once (the proxy then routes to
another node) and leaves no process behind.
"""
from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
from urllib.parse import urlparse

import pytest

from pdserve.deploy.server_process import PD_SERVE, ServerProcess
from pdserve.serving import LLM, SamplingParams
from tests.helpers.parallel import child_pids, wait_gone
from tests.helpers.timing import HANG_S

PROMPT = "The quick brown fox"


def _completion(server: ServerProcess, max_tokens: int) -> list[str]:
    status, _, body = server.request("POST", "/v1/completions", {
        "model": server.model_name, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True})
    assert status == 200, body
    return json.loads(body)["choices"][0]["text"]


@pytest.mark.slow  # seconds: outside make test-quick
def test_pd_serve_pp2_answers_as_one_process_and_logs_its_layout(tiny_llama):
    want = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="16MiB").generate(
        PROMPT, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].outputs[0].text
    with ServerProcess("--model", str(tiny_llama), "--dtype", "float32", "--kv-cache-memory", "16MiB",
                       "-pp", "2") as server:
        ranks = child_pids(server.proc.pid)
        assert len(ranks) == 1
        status, _, body = server.request("GET", "/v1/models")
        server.model_name = json.loads(body)["data"][0]["id"]
        assert _completion(server, 12) == want
        log = server.log
    assert "parallel layout: tensor_parallel_size 1 x pipeline_parallel_size 2 = 2 ranks" in log
    assert "rank 1 (pp 1, tp 0): layers [2, 4)" in log
    assert "rank 1: KV cache: 16777216 bytes budget // (2 layers x 8192 bytes/block/layer) = 1024 blocks" in log
    assert server.proc.returncode == 0
    assert not wait_gone(ranks)


@pytest.mark.slow  # seconds: outside make test-quick
def test_pd_serve_exits_of_itself_when_a_rank_dies_mid_stream(tiny_llama):
    server = ServerProcess("--model", str(tiny_llama), "--dtype", "float32", "--kv-cache-memory", "16MiB",
                           "--tensor-parallel-size", "2").start()
    try:
        (rank1,) = child_pids(server.proc.pid)
        url = urlparse(server.url)
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
        conn.request("POST", "/v1/completions", json.dumps({
            "prompt": PROMPT, "max_tokens": 2000, "temperature": 0, "ignore_eos": True, "stream": True}),
            {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.readline().startswith(b"data: ")  # tokens are flowing
        os.kill(rank1, signal.SIGKILL)
        # docs/parallelism.md: gone within a second or two; only a server that lingers on without its rank
        # (it would, serving errors, were supervision broken) reaches the deadline.
        code = server.proc.wait(timeout=HANG_S)
        assert code != 0
        assert "rank 1 (pid %d) exited with code -9" % rank1 in server.log
        assert "this server exits" in server.log
        assert not wait_gone({rank1})
    finally:
        server.stop()


def test_make_serve_passes_the_layout_flags_to_both_nodes():
    from pdserve.deploy.local_cluster import build_parser, parallel_args

    assert parallel_args(build_parser().parse_args(["-tp", "2", "--pipeline-parallel-size", "3"])) == \
        ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "3"]
    assert parallel_args(build_parser().parse_args([])) == []
    with pytest.raises(SystemExit):
        build_parser().parse_args(["-tp", "0"])


def test_a_tp_the_model_does_not_take_stops_start_up_naming_the_values_it_takes(tmp_path):
    """Issue 40 item 7d: SmolLM2-135M (make serve's default) has 9 attention heads and 3 KV heads; -tp 2 stops
    pd-serve with one line that says which values it takes (1 or 3), here on a random model of that head layout."""
    from pdserve.engine.builtin_model import make_model

    model = make_model(tmp_path / "nine-heads", preset="tiny", num_kv_heads=3, num_attention_heads=9, hidden_size=144,
                       head_dim=16, intermediate_size=192)
    proc = subprocess.run([*PD_SERVE, "--port", "0", "--model", str(model), "--kv-cache-memory", "16MiB", "-tp", "2"],
                          capture_output=True, text=True, timeout=HANG_S, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].endswith("tensor_parallel_size=2 must divide the model's 9 attention heads; this model takes "
                             "tensor_parallel_size (-tp) 1 or 3"), lines
