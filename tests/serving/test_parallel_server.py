"""-tp / -pp on the servers: a real pd-serve with its rank processes, and its supervision.

A server that loses a rank cannot answer any more: it exits non-zero at once (the proxy then routes to
another node) and leaves no process behind.
"""
from __future__ import annotations

import contextlib
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
    """SmolLM2-135M (make serve's default) has 9 attention heads and 3 KV heads; -tp 2 stops
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


@pytest.fixture(scope="module")
def six_heads(tmp_path_factory):
    """A random model whose 6 heads (and KV heads) and 192 MLP units split over -tp 2 and -tp 3."""
    from pdserve.engine.builtin_model import make_model

    return make_model(tmp_path_factory.mktemp("six-heads"), preset="tiny", num_kv_heads=6, num_attention_heads=6,
                      hidden_size=96, intermediate_size=192)


def _decode_node(model, tmp_path, tp: int, shutdown_s: float) -> ServerProcess:
    """A real pd-decode with `tp` ranks and a file store."""
    from pdserve.deploy.processes import console_script

    return ServerProcess("--model", str(model), "--dtype", "float32", "--kv-cache-memory", "16MiB", "-tp", str(tp),
                         "--grpc-port", "0", "--kv-store", f"file://{tmp_path / 'kv'}", "--shutdown-timeout",
                         str(shutdown_s), exe=console_script("pd-decode")).start(timeout=HANG_S)


def _open_stream(server: ServerProcess, max_tokens: int) -> http.client.HTTPResponse:
    url = urlparse(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=HANG_S)
    conn.request("POST", "/v1/completions", json.dumps({
        "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}),
        {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")  # tokens are flowing
    return resp


@pytest.mark.slow  # seconds: outside make test-quick
@pytest.mark.parametrize("tp", [2, 3])
def test_sigterm_stops_a_tp_node_within_the_documented_bound_even_with_a_rank_that_does_not_answer(
        six_heads, tmp_path, tp):
    """SIGTERM to a -tp node is obeyed within --shutdown-timeout + STOP_GRACE_S
    (docs/operations.md), ranks included, even while a step waits on a rank that does not answer (here a
    SIGSTOPped one, mid-stream): without that bound the node waits out the collective's deadline
    (distributed_timeout_s, 60 s) and longer."""
    from pdserve.engine.config import ParallelConfig
    from pdserve.serving.http import STOP_GRACE_S

    shutdown_s = 1.0
    server = _decode_node(six_heads, tmp_path, tp, shutdown_s)
    ranks = child_pids(server.proc.pid)
    assert len(ranks) == tp - 1
    frozen = min(ranks)
    try:
        _open_stream(server, 2000)
        os.kill(frozen, signal.SIGSTOP)
        server.proc.send_signal(signal.SIGTERM)
        # Told apart from the collective's deadline, which the node would otherwise wait out: half of it.
        code = server.proc.wait(timeout=ParallelConfig().distributed_timeout_s / 2)
        assert code is not None
        assert not wait_gone(ranks), "rank processes left behind"
        assert f"did not stop within {shutdown_s + STOP_GRACE_S:g} s of the signal" in server.log
    finally:
        for pid in ranks:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGCONT)
        server.stop(signal.SIGKILL)


@pytest.mark.slow  # seconds: outside make test-quick
def test_sigterm_to_the_whole_process_group_of_a_tp_node_drains_its_streams(six_heads, tmp_path):
    """SIGTERM to every process of a -tp 3 node (a process group's signal: Ctrl-C, systemd, `kill -- -PGID`): the
    ranks leave it to rank 0, which lets the running stream finish (drain) and exits 0 with its ranks."""
    server = _decode_node(six_heads, tmp_path, 3, HANG_S)
    ranks = child_pids(server.proc.pid)
    try:
        resp = _open_stream(server, 64)
        for pid in [server.proc.pid, *ranks]:
            os.kill(pid, signal.SIGTERM)
        body = resp.read().decode()
        assert '"finish_reason":"length"' in body.replace(" ", ""), body[-2000:]
        assert server.proc.wait(timeout=HANG_S) == 0
        assert not wait_gone(ranks), "rank processes left behind"
        assert "lost a rank" not in server.log
    finally:
        server.stop(signal.SIGKILL)
