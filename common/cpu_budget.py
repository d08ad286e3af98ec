"""The CPUs a process may use, and the threads and OpenMP wait of the engines that run on them.

A host's core count says nothing about a container's share of it. Two things bound what a process can
run: the CPU quota of its cgroup (v2 `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`; the
smallest over its cgroup and every ancestor) and its affinity mask (`taskset`, a cpuset).
`read_budget` reads both; `plan_threads` turns a budget (or `--threads N`, or `OMP_NUM_THREADS`) into the
torch threads of an engine's rank processes; `prepare_openmp` decides, before libgomp starts (it reads
its settings once, when torch is first imported), whether the OpenMP workers wait passively;
`split_cores` sizes the engines a launcher starts together on one host (deploy/processes.py).

libgomp's workers spin ~300000 iterations after each parallel region before they sleep: right for an
engine that owns its cores, ruinous when anything else runs on them: its threads outnumbering the CPUs it
may use, other engines on its cores, or any busy process beside it (the team's barrier then waits at every
region for a thread the scheduler took off its core). An engine therefore starts with `GOMP_SPINCOUNT=100`
(`PASSIVE_ENV`): the workers sleep almost at once. docs/benchmarks.md ("Speed where users run it") measured
the trade: beside one busy process the default spin ran 6x slower than alone, the short spin 1.5x; on an idle
machine the short spin cost 14%. An operator who gives an engine its cores alone sets `GOMP_SPINCOUNT`
(e.g. 300000) or `OMP_WAIT_POLICY`, which always win. No torch here (docs/architecture.md, "One OpenMP team").
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from pdserve.common import env

PASSIVE_ENV = {"GOMP_SPINCOUNT": "100"}
WAIT_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
_set_here: dict[str, str] = {}  # what prepare_openmp put into this process's environment


def _count(n: float, what: str = "CPU") -> str:
    return f"{n:g} {what}" + ("" if n == 1 else "s")



@dataclass(frozen=True)
class CpuBudget:
    """`affinity`: CPUs in the affinity mask; `quota`: CPUs' worth of time the cgroup quota allows per
    second (None: no quota), as `quota_source` says (`cgroup cpu.max 100000/100000`)."""

    affinity: int
    quota: float | None = None
    quota_source: str = ""

    @property
    def limit(self) -> float:
        """CPU-seconds per second the process may use."""
        return float(self.affinity) if self.quota is None else min(float(self.affinity), self.quota)

    @property
    def cpus(self) -> int:
        """Threads that fit: the limit rounded up (1.5 CPUs of quota: 2), at least 1."""
        return max(1, math.ceil(self.limit - 1e-9))

    @property
    def reason(self) -> str:
        affinity = f"affinity {_count(self.affinity)}"
        if self.quota is None:
            return affinity
        quota = f"{self.quota_source} = {_count(round(self.quota, 2))}"
        return f"{quota}; {affinity}" if self.quota < self.affinity else f"{affinity}; {quota}"


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, ValueError):
        return None


def cgroup_mounts(root: Path) -> list[tuple[str, str, str, set[str]]]:
    """(fstype, the mount's root within its hierarchy, mount point, super options) of the cgroup mounts."""
    mounts = []
    for line in (_read(root / "proc/self/mountinfo") or "").splitlines():
        parts = line.split()
        if "-" not in parts:
            continue
        sep = parts.index("-")
        if len(parts) > sep + 3 and parts[sep + 1] in ("cgroup", "cgroup2"):
            mounts.append((parts[sep + 1], parts[3], parts[4], set(parts[sep + 3].split(","))))
    return mounts or [("cgroup2", "/", "/sys/fs/cgroup", set()), ("cgroup", "/", "/sys/fs/cgroup/cpu", {"cpu"})]


def _dirs(mount_dir: Path, mount_root: str, cgroup_path: str) -> list[Path]:
    """The process's cgroup directory under a mount and its ancestors up to the mount; the mount alone when
    the cgroup is not visible there (a container that sees its own cgroup as the mount's root)."""
    rel = os.path.relpath(cgroup_path, mount_root) if cgroup_path.startswith(mount_root) else ".."
    leaf = (mount_dir / rel).resolve() if not rel.startswith("..") else mount_dir
    if not leaf.is_dir() or mount_dir.resolve() not in (leaf, *leaf.parents):
        return [mount_dir]
    out = [leaf]
    while out[-1] != mount_dir.resolve():
        out.append(out[-1].parent)
    return out


def _quota(directory: Path, v2: bool) -> tuple[float, str] | None:
    if v2:
        quota, _, period = (_read(directory / "cpu.max") or "max").partition(" ")
        source = "cgroup cpu.max"
    else:
        quota = _read(directory / "cpu.cfs_quota_us") or "-1"
        period = _read(directory / "cpu.cfs_period_us") or ""
        source = "cgroup cpu.cfs_quota_us/cfs_period_us"
    try:
        q, p = int(quota), int(period or 100000)
    except ValueError:  # "max": no quota
        return None
    return (q / p, f"{source} {q}/{p}") if q > 0 and p > 0 else None


def cgroup_quota(root: Path = Path("/")) -> tuple[float, str] | None:
    """The smallest CPU quota over this process's cgroups (v2 and v1 alike) and their ancestors, in CPUs,
    with where it was read; None without one. `root`: the file system's root (a fake tree in tests)."""
    paths: dict[str, str] = {}  # "" for the v2 hierarchy, else each v1 controller
    for line in (_read(root / "proc/self/cgroup") or "").splitlines():
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        for name in (controllers.split(",") if hierarchy != "0" else [""]):
            paths[name] = path
    found = []
    for fstype, mount_root, mount_point, options in cgroup_mounts(root):
        v2 = fstype == "cgroup2"
        path = paths.get("" if v2 else "cpu")
        if path is None or (not v2 and "cpu" not in options):
            continue
        found += [q for d in _dirs(root / mount_point.lstrip("/"), mount_root, path) if (q := _quota(d, v2))]
    return min(found, default=None)


def read_budget(root: Path = Path("/"), affinity: int | None = None) -> CpuBudget:
    """What this process may use: its affinity mask (or `affinity` CPUs) and its cgroup CPU quota."""
    if affinity is None:
        affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_quota(root)
    return CpuBudget(affinity, *quota) if quota else CpuBudget(affinity)


def operator_wait() -> dict[str, str]:
    """The OpenMP wait settings the operator set (not those prepare_openmp set here)."""
    return {n: os.environ[n] for n in WAIT_SETTINGS if n in os.environ and _set_here.get(n) != os.environ[n]}


@dataclass(frozen=True)
class ThreadPlan:
    """The torch threads of each of an engine's `ranks` processes, `why` that many, on `budget`; `shared`:
    its launcher says other engines share its cores (PDSERVE_SHARED_CORES)."""

    threads: int
    ranks: int
    why: str
    budget: CpuBudget
    shared: bool = False

    @property
    def oversubscribed(self) -> bool:
        return self.threads * self.ranks > self.budget.limit

    def wait_env(self) -> dict[str, str]:
        """What to add to an engine process's environment (before its libgomp starts): the short spin, unless
        the operator chose a wait."""
        return {} if any(n in os.environ for n in WAIT_SETTINGS) else dict(PASSIVE_ENV)

    def line(self) -> str:
        """The start-up log line: the threads chosen and why, and how the OpenMP workers wait."""
        each = f" per rank x {self.ranks} ranks" if self.ranks > 1 else ""
        return f"threads: {_count(self.threads, 'torch thread')}{each} ({self.why}); {self._wait()}"

    def _wait(self) -> str:
        operator = operator_wait()
        if operator:
            return "OpenMP wait as set: " + ", ".join(f"{k}={v}" for k, v in operator.items())
        threads, cpus = _count(self.threads * self.ranks, "thread"), _count(round(self.budget.limit, 2))
        why = (f"{threads} on {cpus}" if self.oversubscribed
               else f"cores shared with other engines: {env.SHARED_CORES.name}" if self.shared
               else "other processes may run on these cores; GOMP_SPINCOUNT=300000 where the engine owns them")
        setting = ", ".join(f"{k}={v}" for k, v in PASSIVE_ENV.items())
        if all(os.environ.get(k) == v for k, v in PASSIVE_ENV.items()):
            return f"OpenMP workers wait passively ({setting}; {why})"
        return (f"OpenMP workers spin though they should wait passively ({why}): libgomp started before pdserve "
                f"could set {setting}; set it (or OMP_WAIT_POLICY=passive) before starting Python")


def plan_threads(requested: int | None = None, ranks: int = 1, budget: CpuBudget | None = None) -> ThreadPlan:
    """`requested` (`--threads N`, the node's total) split over the ranks; else `OMP_NUM_THREADS` for each
    rank process; else the budget's CPUs split over the ranks."""
    budget = budget or read_budget()
    shared = env.flag(env.SHARED_CORES)
    split = f", split over {ranks} ranks" if ranks > 1 else ""
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if requested is not None:
        return ThreadPlan(max(1, requested // ranks), ranks, f"--threads {requested}{split}; {budget.reason}",
                          budget, shared)
    if omp.isdigit() and int(omp) > 0:
        return ThreadPlan(int(omp), ranks, f"OMP_NUM_THREADS={omp}; {budget.reason}", budget, shared)
    return ThreadPlan(max(1, budget.cpus // ranks), ranks, budget.reason + split, budget, shared)


def _libgomp_loaded() -> bool:
    if "torch" in sys.modules:
        return True
    try:
        return "libgomp" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def prepare_openmp(requested: int | None = None, ranks: int = 1) -> ThreadPlan:
    """At an engine process's start, before torch is imported: the plan, and passive OpenMP workers in this
    process's environment unless the operator set a wait of their own."""
    plan = plan_threads(requested, ranks)
    wait = plan.wait_env()
    if wait and not _libgomp_loaded():
        os.environ.update(wait)
        _set_here.update(wait)
    return plan


@dataclass(frozen=True)
class EngineShare:
    """What a launcher gives one of the engines it starts together: `threads` torch threads, on the CPUs
    `cpus` alone (None: shared with the others, which then wait passively)."""

    threads: int
    cpus: tuple[int, ...] | None = None

    @property
    def taskset(self) -> str:
        return ",".join(map(str, self.cpus or ()))


def split_cores(engines: int, budget: CpuBudget, cpu_ids: list[int] | None = None) -> tuple[list[EngineShare], str]:
    """Size `engines` engines started together on this host: with at least 2 CPUs each, each its own
    disjoint slice of the affinity mask (`cpu_ids`) and budget.cpus // engines threads; otherwise all on
    the same cores, each with a thread per CPU and waiting passively: prefill and decode seldom compute at
    the same moment, so each may use every core while the other idles (docs/benchmarks.md, "Speed where
    users run it": P/D on one host 1.3x the throughput of one thread each). The shares, and a line that says
    what was done."""
    cpu_ids = sorted(os.sched_getaffinity(0)) if cpu_ids is None else sorted(cpu_ids)
    threads = max(1, budget.cpus // engines)
    if budget.cpus >= 2 * engines and len(cpu_ids) >= 2 * engines:
        width = len(cpu_ids) // engines
        shares = [EngineShare(threads, tuple(cpu_ids[i * width:(i + 1) * width])) for i in range(engines)]
        return shares, (f"cores: {engines} engines on {_count(budget.cpus)} ({budget.reason}): each pinned to its "
                        f"own {_count(width)}, {_count(threads, 'torch thread')} each")
    return [EngineShare(budget.cpus) for _ in range(engines)], (
        f"cores: {engines} engines on {_count(budget.cpus)} ({budget.reason}): too few to pin each to 2 or more, "
        f"so they share them, {_count(budget.cpus, 'torch thread')} each, OpenMP workers waiting passively")
