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


def test_compute_threads_spin_between_parallel_regions(parallel_model: Path, monkeypatch) -> None:
    # The operator gives the engine its cores alone (libgomp's default spin; the engine's own default is the
    # short spin, common/cpu_budget.py): the one-team property shows as few sleeps per token.
    monkeypatch.setenv("GOMP_SPINCOUNT", "300000")
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


def test_cluster_nodes_are_sized_together(tiny_llama, tmp_path, monkeypatch):
    """A LocalCluster sizes its engines together (common/cpu_budget.py split_cores): on this
    machine's CPUs, each node's threads and whether it is pinned or shares the cores (then told so, and its
    OpenMP workers wait passively: the engine set GOMP_SPINCOUNT before torch loaded, its line says so)."""
    from pdserve.deploy.processes import SHARED_CORES_ENV
    from tests.helpers.cluster import start_cluster

    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    cluster = start_cluster(tiny_llama, tmp_path)
    try:
        assert cluster.cores_line.startswith("cores: 2 engines on ")
        for node, share in zip(cluster.prefill + cluster.decode, cluster.cores):
            env = _environ(node.proc.pid)
            lines = [line for line in node.log_file.read_text().splitlines() if "threads: " in line]
            assert len(lines) == 1 and f"threads: {share.threads} torch thread" in lines[0], (node.name, lines)
            assert f"(--threads {share.threads}; " in lines[0], lines
            if share.cpus is None:
                assert {k: env.get(k) for k in SHARED_CORES_ENV} == SHARED_CORES_ENV, node.name
                assert lines[0].endswith("OpenMP workers wait passively (GOMP_SPINCOUNT=100; cores shared with "
                                         "other engines: PDSERVE_SHARED_CORES)"), lines
            else:
                assert os.sched_getaffinity(node.proc.pid) == set(share.cpus)
                assert "PDSERVE_SHARED_CORES" not in env
        assert "PDSERVE_SHARED_CORES" not in _environ(cluster.proxy.proc.pid)  # not an engine
    finally:
        cluster.stop()


def test_cluster_sizing_on_a_given_budget(tmp_path, monkeypatch):
    """Eight CPUs: each of two nodes pinned to four with four threads; two CPUs: shared, two threads each;
    --threads in the node options: the operator's, the cores shared; no taskset: nothing pinned."""
    from pdserve.common.cpu_budget import CpuBudget
    from pdserve.deploy import processes
    from pdserve.deploy.processes import SHARED_CORES_ENV, ClusterSpec, LocalCluster

    def nodes(cpus: int, node_args: tuple[str, ...] = ()) -> list[tuple[list[str], dict[str, str]]]:
        monkeypatch.setattr(processes, "read_budget", lambda: CpuBudget(cpus))
        monkeypatch.setattr(processes.os, "sched_getaffinity", lambda pid: set(range(cpus)))
        cluster = LocalCluster(ClusterSpec(model="m", log_dir=tmp_path, kv_store="file:///nowhere",
                                           node_args=list(node_args)))
        return [(n.argv, n.env) for n in cluster.prefill + cluster.decode]

    (p_argv, p_env), (d_argv, d_env) = nodes(8)
    assert p_argv[:3] == ["taskset", "-c", "0,1,2,3"] and d_argv[:3] == ["taskset", "-c", "4,5,6,7"]
    assert p_argv[p_argv.index("--threads") + 1] == "4" and p_env == d_env == {}
    for argv, env in nodes(2):  # shared: each may use both CPUs while the other idles
        assert argv[0] != "taskset" and argv[argv.index("--threads") + 1] == "2" and env == SHARED_CORES_ENV
    for argv, env in nodes(8, ("--threads", "3")):
        assert argv[0] != "taskset" and argv.count("--threads") == 1 and env == SHARED_CORES_ENV
    monkeypatch.setattr(processes.shutil, "which", lambda name: None)
    for argv, env in nodes(8):  # no taskset: shared, each with a thread per CPU
        assert argv[0] != "taskset" and argv[argv.index("--threads") + 1] == "8" and env == SHARED_CORES_ENV
