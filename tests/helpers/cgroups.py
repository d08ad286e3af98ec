"""A real cgroup with a CPU quota (root only), for the tests of common/cpu_budget.py and the engines' threads.

Whichever hierarchy has the `cpu` controller: cgroup v2 (`cpu.max`) or v1 (`cpu.cfs_quota_us`). The group is
made under that hierarchy's root and removed afterwards; a process enters it with `cgroup_argv` (a shell
that writes its own pid to `cgroup.procs`, then execs the command).
"""
from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.common.cpu_budget import cgroup_mounts


def _cpu_hierarchy() -> tuple[Path, bool] | None:
    """(mount point, is v2) of the hierarchy with the cpu controller, if any."""
    for fstype, mount_root, point, options in cgroup_mounts(Path("/")):
        if mount_root != "/":
            continue
        path = Path(point)
        if fstype == "cgroup2":
            with contextlib.suppress(OSError):
                if "cpu" in (path / "cgroup.controllers").read_text().split():
                    return path, True
        elif "cpu" in options and path.is_dir():
            return path, False
    return None


@contextlib.contextmanager
def cpu_quota(quota_us: int, period_us: int = 100_000) -> Iterator[list[str]]:
    """A new cgroup allowing quota_us of CPU time per period_us; yields the argv prefix that runs a command
    in it. Its processes still running at the end are killed (the test's own), then the group is removed."""
    found = _cpu_hierarchy()
    if found is None:
        pytest.skip("no cgroup hierarchy with the cpu controller is mounted")
    mount, v2 = found
    group = mount / f"pdserve-test-{uuid.uuid4().hex[:8]}"
    if v2:
        (mount / "cgroup.subtree_control").write_text("+cpu")
    group.mkdir()
    try:
        if v2:
            (group / "cpu.max").write_text(f"{quota_us} {period_us}")
        else:
            (group / "cpu.cfs_period_us").write_text(str(period_us))
            (group / "cpu.cfs_quota_us").write_text(str(quota_us))
        yield ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh"]
    finally:
        for _ in range(100):
            pids = [int(p) for p in (group / "cgroup.procs").read_text().split()]
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.05)
