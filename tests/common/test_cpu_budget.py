"""common/cpu_budget.py: the CPUs a process may use (cgroup v2/v1 quota, affinity), read from fake cgroup
trees and, as root, from a real cgroup and a real affinity mask; the threads and OpenMP wait planned on them;
the split of one host's cores between the engines a launcher starts together."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.common import cpu_budget, env
from pdserve.common.cpu_budget import PASSIVE_ENV, CpuBudget, plan_threads, read_budget, split_cores
from tests.helpers.cgroups import cpu_quota

V2_MOUNT = "30 20 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"


def _tree(root: Path, self_cgroup: str, mountinfo: str, files: dict[str, str]) -> Path:
    """A fake file system under `root`: /proc/self/cgroup, /proc/self/mountinfo and cgroup files."""
    for rel, text in {"proc/self/cgroup": self_cgroup, "proc/self/mountinfo": mountinfo, **files}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


@pytest.fixture(autouse=True)
def _plain_environment(monkeypatch):
    for name in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", env.SHARED_CORES.name):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cpu_budget, "_set_here", {})


def test_v2_the_smallest_quota_over_the_cgroup_and_its_ancestors(tmp_path):
    root = _tree(tmp_path, "0::/kubepods/pod1/ctr\n", V2_MOUNT, {
        "sys/fs/cgroup/kubepods/cpu.max": "max 100000",
        "sys/fs/cgroup/kubepods/pod1/cpu.max": "150000 100000",
        "sys/fs/cgroup/kubepods/pod1/ctr/cpu.max": "400000 100000"})
    budget = read_budget(root, affinity=4)
    assert (budget.quota, budget.quota_source) == (1.5, "cgroup cpu.max 150000/100000")
    assert (budget.cpus, budget.limit) == (2, 1.5)  # 1.5 CPUs of time: 2 threads fit, and use 1.5
    assert budget.reason == "cgroup cpu.max 150000/100000 = 1.5 CPUs; affinity 4 CPUs"
    assert read_budget(root, affinity=1).cpus == 1  # the affinity mask is the tighter bound
    assert read_budget(root, affinity=1).reason == "affinity 1 CPU; cgroup cpu.max 150000/100000 = 1.5 CPUs"


def test_no_quota_anywhere_is_the_affinity_mask(tmp_path):
    root = _tree(tmp_path, "0::/user.slice\n", V2_MOUNT, {"sys/fs/cgroup/user.slice/cpu.max": "max 100000"})
    assert read_budget(root, affinity=3) == CpuBudget(3)
    assert read_budget(root, affinity=3).reason == "affinity 3 CPUs"
    assert read_budget(tmp_path / "nothing-here", affinity=2) == CpuBudget(2)  # no /proc, no cgroup fs


def test_a_container_that_sees_its_own_cgroup_as_the_root(tmp_path):
    """cgroup namespaces: /proc/self/cgroup says "/", the mount's root is the container's cgroup."""
    root = _tree(tmp_path, "0::/\n", V2_MOUNT, {"sys/fs/cgroup/cpu.max": "50000 100000"})
    budget = read_budget(root, affinity=8)
    assert (budget.quota, budget.cpus, budget.limit) == (0.5, 1, 0.5)
    # No namespace: the path names a cgroup the container's mount does not show; the mount's own quota counts.
    root = _tree(tmp_path / "b", "0::/system.slice/docker-1.scope\n", V2_MOUNT,
                 {"sys/fs/cgroup/cpu.max": "200000 100000"})
    assert read_budget(root, affinity=8).quota == 2.0


def test_v1_cfs_quota_in_a_hybrid_layout(tmp_path):
    mountinfo = (V2_MOUNT.replace("/sys/fs/cgroup ", "/sys/fs/cgroup/unified ")
                 + "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
                 + "33 31 0:30 /docker/abc /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n")
    root = _tree(tmp_path, "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/docker/abc\n", mountinfo, {
        "sys/fs/cgroup/cpu,cpuacct/docker/cpu.cfs_quota_us": "-1",
        "sys/fs/cgroup/cpu,cpuacct/docker/cpu.cfs_period_us": "100000",
        "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "300000",
        "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000",
        "sys/fs/cgroup/memory/cpu.cfs_quota_us": "100000"})  # not the cpu hierarchy: ignored
    budget = read_budget(root, affinity=16)
    assert (budget.quota, budget.quota_source) == (3.0, "cgroup cpu.cfs_quota_us/cfs_period_us 300000/100000")
    assert budget.cpus == 3
    # A v2 quota too (a hybrid host): the smaller one counts.
    (tmp_path / "sys/fs/cgroup/unified/docker/abc").mkdir(parents=True)
    (tmp_path / "sys/fs/cgroup/unified/docker/abc/cpu.max").write_text("100000 100000")
    assert read_budget(root, affinity=16).quota == 1.0


def test_threads_from_the_budget_the_flag_or_omp_num_threads(monkeypatch):
    one_cpu = CpuBudget(2, 1.0, "cgroup cpu.max 100000/100000")
    plan = plan_threads(None, 1, one_cpu)
    assert (plan.threads, plan.oversubscribed, plan.wait_env()) == (1, False, PASSIVE_ENV)  # passive by default
    # Not applied in this process (prepare_openmp never ran here): the line says the workers still spin.
    assert plan.line() == ("threads: 1 torch thread (cgroup cpu.max 100000/100000 = 1 CPU; affinity 2 CPUs); "
                           "OpenMP workers spin though they should wait passively (other processes may run on "
                           "these cores; GOMP_SPINCOUNT=300000 where the engine owns them): libgomp started before "
                           "pdserve could set GOMP_SPINCOUNT=100; set it (or OMP_WAIT_POLICY=passive) before "
                           "starting Python")
    forced = plan_threads(3, 1, one_cpu)
    assert (forced.threads, forced.oversubscribed, forced.wait_env()) == (3, True, PASSIVE_ENV)
    assert forced.why.startswith("--threads 3; ")
    assert "spin though they should wait passively (3 threads on 1 CPU)" in forced.line()
    monkeypatch.setenv("GOMP_SPINCOUNT", "5000")  # the operator's choice wins
    assert forced.wait_env() == {}
    assert forced.line().endswith("; OpenMP wait as set: GOMP_SPINCOUNT=5000")
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert plan_threads(None, 2, one_cpu).threads == 4  # each rank's, as libgomp reads it
    assert plan_threads(2, 2, one_cpu).threads == 1  # the flag still wins


def test_ranks_share_the_budget_not_the_affinity_mask():
    quota = CpuBudget(16, 4.0, "cgroup cpu.max 400000/100000")
    plan = plan_threads(None, 2, quota)
    assert (plan.threads, plan.oversubscribed) == (2, False)
    assert plan.line().startswith("threads: 2 torch threads per rank x 2 ranks (cgroup cpu.max 400000/100000 = 4 CPUs; "
                                  "affinity 16 CPUs, split over 2 ranks)")
    crowded = plan_threads(None, 4, CpuBudget(2))  # at least one thread each: 4 threads on 2 CPUs
    assert (crowded.threads, crowded.oversubscribed, crowded.wait_env()) == (1, True, PASSIVE_ENV)


def test_a_launcher_that_says_the_cores_are_shared(monkeypatch):
    monkeypatch.setenv(env.SHARED_CORES.name, "1")
    plan = plan_threads(None, 1, CpuBudget(2))
    assert (plan.threads, plan.oversubscribed, plan.shared) == (2, False, True)
    assert "cores shared with other engines: PDSERVE_SHARED_CORES" in plan.line()
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    assert plan.wait_env() == {}


def test_prepare_openmp_sets_the_wait_only_before_libgomp_starts():
    """A fresh interpreter: set before torch loads, named in the line; an interpreter that already loaded torch
    sets nothing (libgomp read its settings already) and its line says so."""
    code = ("import json, os, sys\n"
            "from pdserve.common.cpu_budget import prepare_openmp\n"
            "if sys.argv[1] == 'late': import torch\n"
            "plan = prepare_openmp(64)\n"
            "print(json.dumps([os.environ.get('GOMP_SPINCOUNT'), plan.line()]))")
    environ = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    early, late = (json.loads(subprocess.run([sys.executable, "-c", code, when], capture_output=True, text=True,
                                             env=environ, check=True).stdout) for when in ("early", "late"))
    assert early[0] == "100" and "OpenMP workers wait passively (GOMP_SPINCOUNT=100; 64 threads on" in early[1]
    assert late[0] is None and "libgomp started before pdserve could set GOMP_SPINCOUNT=100" in late[1]


def test_engines_started_together_split_the_cores():
    shares, line = split_cores(2, CpuBudget(8), list(range(8)))
    assert [(s.threads, s.taskset) for s in shares] == [(4, "0,1,2,3"), (4, "4,5,6,7")]
    assert line == "cores: 2 engines on 8 CPUs (affinity 8 CPUs): each pinned to its own 4 CPUs, 4 torch threads each"
    quota = CpuBudget(16, 4.0, "cgroup cpu.max 400000/100000")  # pinned to halves of the mask, threads by quota
    assert [(s.threads, len(s.cpus)) for s in split_cores(2, quota, list(range(16)))[0]] == [(2, 8), (2, 8)]
    shares, line = split_cores(2, CpuBudget(2), [0, 1])
    assert [(s.threads, s.cpus) for s in shares] == [(2, None), (2, None)]  # each may use every core
    assert "share them, 2 torch threads each, OpenMP workers waiting passively" in line
    assert [s.threads for s in split_cores(3, CpuBudget(4), [0, 1, 2, 3])[0]] == [4, 4, 4]


_REPORT = ("from pdserve.common.cpu_budget import read_budget, plan_threads; b = read_budget(); "
           "print(b.affinity, b.quota, b.cpus, plan_threads(None, 1, b).line())")


def _report(prefix: list[str]) -> tuple[int, float | None, int, str]:
    out = subprocess.run([*prefix, sys.executable, "-c", _REPORT], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": ""}).stdout.split(" ", 3)
    return int(out[0]), None if out[1] == "None" else float(out[1]), int(out[2]), out[3].strip()


def test_a_real_affinity_mask():
    affinity, _, cpus, line = _report(["taskset", "-c", "0"])
    assert (affinity, cpus) == (1, 1)
    assert line.startswith("threads: 1 torch thread (affinity 1 CPU")


@pytest.mark.root("makes a cgroup with a CPU quota")
def test_a_real_cgroup_quota_and_affinity_mask():
    """A real process in a real cgroup with 1 CPU of quota, alone and under taskset."""
    mine = read_budget()
    with cpu_quota(100_000, 100_000) as in_group:
        affinity, quota, cpus, line = _report(in_group)
        assert affinity == mine.affinity and quota == min(1.0, mine.quota or 1.0) and cpus == 1
        assert "cgroup cpu" in line and "100000/100000 = 1 CPU" in line and line.startswith("threads: 1 torch thread")
        affinity, quota, cpus, _ = _report([*in_group, "taskset", "-c", "0"])
        assert (affinity, quota, cpus) == (1, 1.0, 1)
    with cpu_quota(50_000, 100_000) as in_group:
        _, quota, cpus, line = _report(in_group)
        assert (quota, cpus) == (0.5, 1) and "= 0.5 CPUs" in line
