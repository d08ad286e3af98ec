"""An engine sizes its threads from what its process may use: real pd-serve processes
under a real cgroup CPU quota, an affinity mask, `--threads`, an operator's OpenMP settings and -tp ranks.

What each start-up says is its "threads:" line (common/cpu_budget.py `ThreadPlan.line`). A wait setting the
server puts into its own environment does not show in /proc/<pid>/environ (that is the environment it was
started with); the one a rank process is started with does.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.common.cpu_budget import read_budget
from pdserve.deploy.server_process import PD_SERVE, ServerProcess
from tests.helpers.cgroups import cpu_quota
from tests.helpers.parallel import child_pids

_WAIT = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "OMP_NUM_THREADS", "PDSERVE_SHARED_CORES")


@pytest.fixture(autouse=True)
def _no_thread_settings(monkeypatch):
    for name in _WAIT:
        monkeypatch.delenv(name, raising=False)


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def _threads_line(model: Path, *args: str, exe: list[str] = PD_SERVE) -> str:
    """Start pd-serve, answer one completion, stop it; its "threads:" line."""
    with ServerProcess("--model", str(model), "--dtype", "float32", "--kv-cache-memory", "16MiB", *args,
                       exe=exe) as server:
        status, _, body = server.request("POST", "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2})
        assert status == 200, body
        lines = re.findall(r"threads: .*", server.log)
    assert len(lines) == 1, lines
    return lines[0]


def test_entry_points_start_no_openmp_before_they_choose_its_wait():
    """pd-serve, pd-prefill and pd-decode decide the OpenMP wait in their main (serving/server.py run_node):
    importing them must not load torch or libgomp, which reads GOMP_SPINCOUNT once, when it loads."""
    for module in ("pdserve.serving.server", "pdserve.serving.node", "pdserve.prefill_node.__main__",
                   "pdserve.decode_node.__main__"):
        code = (f"import sys, {module}; from pathlib import Path; "
                "print('torch' in sys.modules, 'libgomp' in Path('/proc/self/maps').read_text())")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        assert out.split() == ["False", "False"], module


@pytest.mark.slow  # seconds: two servers
@pytest.mark.root("makes a cgroup with a CPU quota")
def test_pd_serve_under_a_one_cpu_quota(tiny_llama):
    affinity = read_budget().affinity
    with cpu_quota(100_000, 100_000) as in_group:
        line = _threads_line(tiny_llama, exe=[*in_group, *PD_SERVE])
        assert re.match(r"threads: 1 torch thread \(cgroup cpu[.\w/]* 100000/100000 = 1 CPU", line), line
        assert f"affinity {affinity} CPU" in line
        line = _threads_line(tiny_llama, "--threads", "3", exe=[*in_group, *PD_SERVE])
    assert line.startswith("threads: 3 torch threads (--threads 3; "), line
    assert line.endswith("OpenMP workers wait passively (GOMP_SPINCOUNT=100; 3 threads on 1 CPU)"), line


@pytest.mark.slow  # seconds: a server
def test_pd_serve_pinned_to_one_cpu(tiny_llama):
    line = _threads_line(tiny_llama, exe=["taskset", "-c", "0", *PD_SERVE])
    assert line.startswith("threads: 1 torch thread (affinity 1 CPU"), line
    assert line.endswith("OpenMP workers wait passively (GOMP_SPINCOUNT=100; other processes may run on these "
                         "cores; GOMP_SPINCOUNT=300000 where the engine owns them)"), line


@pytest.mark.slow  # seconds: a server
def test_the_operators_openmp_wait_wins(tiny_llama, monkeypatch):
    monkeypatch.setenv("GOMP_SPINCOUNT", "5000")
    threads = read_budget().cpus + 1
    line = _threads_line(tiny_llama, "--threads", str(threads))
    assert line.startswith(f"threads: {threads} torch threads (--threads {threads}; "), line
    assert line.endswith("; OpenMP wait as set: GOMP_SPINCOUNT=5000"), line


@pytest.mark.slow  # seconds: a server with a rank process
def test_ranks_divide_the_threads_and_wait_passively_when_they_outnumber_the_cpus(tiny_llama):
    per_rank = read_budget().cpus + 1  # more than the affinity mask's half, and 2 ranks oversubscribe
    with ServerProcess("--model", str(tiny_llama), "--dtype", "float32", "--kv-cache-memory", "16MiB",
                       "-tp", "2", "--threads", str(2 * per_rank)) as server:
        (rank1,) = child_pids(server.proc.pid)
        rank_env = _environ(rank1)
        log = server.log
    assert (rank_env.get("OMP_NUM_THREADS"), rank_env.get("GOMP_SPINCOUNT")) == (str(per_rank), "100")
    (line,) = re.findall(r"threads: .*", log)
    assert line.startswith(f"threads: {per_rank} torch threads per rank x 2 ranks (--threads {2 * per_rank}, "
                           "split over 2 ranks; "), line
    assert "OpenMP workers wait passively (GOMP_SPINCOUNT=100" in line
    assert f"{per_rank} torch threads per rank" in log.split("parallel: started ranks")[1].splitlines()[0]


def test_threads_is_an_engine_option():
    from pdserve.engine.config import EngineConfig

    assert EngineConfig.from_kwargs("m", threads=3).device.threads == 3
    with pytest.raises(ValueError, match="threads must be an integer >= 1"):
        EngineConfig.from_kwargs("m", threads=0)
    out = subprocess.run([*PD_SERVE, "--threads", "0"], capture_output=True, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 2 and "--threads" in out.stderr
