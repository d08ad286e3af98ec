"""A serving process runs its CPU compute as one OpenMP team, as the offline engine does.

When a second thread of the process (the main thread that loaded the weights, say) has run
parallel ops, libgomp manages more threads than there are CPUs and shortens its spin-wait to
almost nothing: the engine's worker threads then go to sleep after every parallel region and are
woken for the next, dozens of times per decoded token, which made pd-serve ~15% slower per token
than `LLM.generate` on a 2-core machine (engine/async_engine.py, `AsyncLLMEngine.build`). Observable
from outside: the voluntary context switches of the server's threads while it decodes.
"""
from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

import pytest

from pdserve.deploy.server_process import ServerProcess

pytestmark = pytest.mark.slow

TOKENS = 48


@pytest.fixture(scope="module")
def parallel_model(tmp_path_factory) -> Path:
    """bf16 weights wide enough that a one-token decode step runs its linear layers on every thread."""
    from pdserve.engine.builtin_model import make_model

    path = tmp_path_factory.mktemp("bench-2-layers")
    make_model(path, preset="bench", arch="llama", num_hidden_layers=2)
    return path


def _threads(pid: int) -> dict[int, tuple[float, int]]:
    """tid -> (CPU seconds, voluntary context switches)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        voluntary = int(status.split("\nvoluntary_ctxt_switches:")[1].split()[0])
        out[int(tid)] = (cpu, voluntary)
    return out


def _complete(url: str, max_tokens: int) -> dict:
    body = {"prompt": list(range(10, 74)), "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def test_compute_threads_spin_between_parallel_regions(parallel_model: Path) -> None:
    server = ServerProcess("--model", str(parallel_model), "--kv-cache-memory", "128MiB").start(timeout=300)
    try:
        _complete(server.url, 4)  # warm-up: kernels built, pools created
        pid = server.proc.pid
        before = _threads(pid)
        assert _complete(server.url, TOKENS)["usage"]["completion_tokens"] == TOKENS
        after = _threads(pid)
    finally:
        server.stop()
    # The compute threads: those that worked through the decode (the event loop thread barely does).
    busy = {tid: (after[tid][0] - before.get(tid, (0.0, 0))[0], after[tid][1] - before.get(tid, (0.0, 0))[1])
            for tid in after if tid != pid}
    compute = {tid: v for tid, v in busy.items() if v[0] >= 0.2 * max(c for c, _ in busy.values())}
    assert len(compute) >= 2, f"the decode did not run on several threads: {busy}"
    # Spinning workers sleep about once per token (between steps); throttled ones once per parallel
    # region: dozens of times per token even with two layers.
    for tid, (cpu, switches) in compute.items():
        assert switches / TOKENS < 4, (f"thread {tid} slept {switches} times in {TOKENS} tokens ({cpu:.2f} s CPU): "
                                      "the compute threads are not one OpenMP team")


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_cluster_nodes_that_share_cores_wait_briefly(tiny_llama, tmp_path, monkeypatch):
    """A LocalCluster's engines share the machine's cores, so their workers spin only briefly before
    sleeping (deploy/processes.py SHARED_CORES_ENV); an operator's own OpenMP wait setting wins."""
    from pdserve.deploy.processes import SHARED_CORES_ENV, shared_cores_env
    from tests.helpers.cluster import start_cluster

    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)
    cluster = start_cluster(tiny_llama, tmp_path)
    try:
        for node in cluster.prefill + cluster.decode:
            env = _environ(node.proc.pid)
            assert {k: env.get(k) for k in SHARED_CORES_ENV} == SHARED_CORES_ENV, node.name
        assert "GOMP_SPINCOUNT" not in _environ(cluster.proxy.proc.pid)  # not an engine
    finally:
        cluster.stop()
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert shared_cores_env({"X": "1"}) == {"X": "1"}
    monkeypatch.delenv("OMP_WAIT_POLICY")
    assert shared_cores_env({"GOMP_SPINCOUNT": "5000"}) == {"GOMP_SPINCOUNT": "5000"}
    assert shared_cores_env({}) == SHARED_CORES_ENV
