"""Rank 0 starts ranks 1..N-1 as child processes and supervises them.

Each child is `python -m pdserve.engine.parallel.worker`, reading its rank, the rendezvous port and the
engine config as one JSON line on stdin. The rendezvous is a TCPStore on a free port of 127.0.0.1 (the
ranks of a node share its machine). A child dies with its parent (engine/parallel/worker.py); rank 0
polls its children and, when one exits, logs it, stops the others and calls `on_death` (a server exits:
engine/async_engine.py; the offline LLM's next step raises).

It also owns an engine's threads (`engine_threads`, `threads_per_rank`; common/cpu_budget.py decides
them). Torch is imported only once ranks start: importing this module (the servers do, through
engine/async_engine.py) must not start libgomp before the entry point has chosen its OpenMP wait.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from pdserve.common.cpu_budget import ThreadPlan, plan_threads
from pdserve.engine.config import EngineConfig

logger = logging.getLogger(__name__)

_POLL_S = 0.2
_STOP_WAIT_S = 10.0


def engine_threads(config: EngineConfig) -> ThreadPlan:
    """An engine's threads, at its start: `config.device.threads` (`--threads`), else the CPUs the process may
    use (cgroup quota, affinity), split over its ranks (common/cpu_budget.py); logged once. A single-rank
    engine sets torch's threads here (on the thread that runs its steps); ranks get theirs from
    RankProcesses. Torch is not imported before: a server decides its OpenMP wait first (serving/server.py).
    The engine logs `plan.line()` once its model has loaded."""
    plan = plan_threads(config.device.threads, config.parallel.world_size)
    if plan.ranks == 1:
        import torch

        torch.set_num_threads(plan.threads)
    return plan


def threads_per_rank(config: EngineConfig) -> tuple[int, dict[str, str]]:
    """The ranks of a node share its CPUs (its budget, or `--threads`): each gets an equal share of torch
    threads (OMP_NUM_THREADS, when the operator set it, is each rank's). Two ranks with a full team each on
    the same cores make libgomp's teams wait on each other's spinning threads (docs/architecture.md, "One
    OpenMP team"). Also the environment the ranks start with: their thread count, and passive OpenMP workers
    when the ranks' threads outnumber the CPUs, unless the operator chose a wait."""
    plan = plan_threads(config.device.threads, config.parallel.world_size)
    return plan.threads, {"OMP_NUM_THREADS": str(plan.threads), **plan.wait_env()}


def joined_key(rank: int) -> str:
    return f"joined/{rank}"


def config_to_json(config: EngineConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)


class RankFailure(RuntimeError):
    """A rank died or never joined: the engine cannot step any more."""


def exit_process(rank: int, code: int | None) -> None:
    """A server's policy: without one of its ranks it cannot answer, so it exits at once (non-zero) and its
    clients' proxy routes elsewhere; the other ranks were killed already."""
    logger.critical("parallel: rank %d exited (code %s); this server exits", rank, code)
    logging.shutdown()
    os._exit(1)


class RankProcesses:
    def __init__(self, config: EngineConfig, connector_factory: str | None = None) -> None:
        """`connector_factory`: `module:qualname` of the KV connector factory every rank makes its connector with."""
        import torch
        import torch.distributed as dist

        par = config.parallel
        self.world = par.world_size
        self.timeout_s = par.distributed_timeout_s
        self.store = dist.TCPStore("127.0.0.1", 0, self.world, True,
                                   timeout=datetime.timedelta(seconds=self.timeout_s), wait_for_workers=False)
        self.port = self.store.port
        self.on_death: Callable[[int, int | None], None] | None = None
        self.failure: str | None = None
        self._stopping = False
        self.procs: dict[int, subprocess.Popen] = {}
        spec = config_to_json(config)
        threads, rank_env = threads_per_rank(config)
        env = {**os.environ, **rank_env}
        for rank in range(1, self.world):
            proc = subprocess.Popen([sys.executable, "-m", "pdserve.engine.parallel.worker"], stdin=subprocess.PIPE,
                                    env=env)
            self.procs[rank] = proc
            try:
                proc.stdin.write(json.dumps({"rank": rank, "port": self.port, "config": spec,
                                             "connector_factory": connector_factory}).encode() + b"\n")
                proc.stdin.close()
            except BrokenPipeError:  # it died before reading its config: wait_joined names it as the failed rank
                with contextlib.suppress(BrokenPipeError):
                    proc.stdin.close()
        self._threads_before = torch.get_num_threads()
        torch.set_num_threads(threads)  # given back when the ranks stop: a later engine in this process gets all
        logger.info("parallel: started ranks %s (pids %s), rendezvous 127.0.0.1:%d, %s torch threads per rank",
                    list(self.procs), [p.pid for p in self.procs.values()], self.port, threads)

    def wait_joined(self) -> None:
        """Until every child has loaded its shard and connected; a child that exits or a deadline fails."""
        deadline = time.monotonic() + self.timeout_s
        keys = [joined_key(r) for r in self.procs]
        while not self.store.check(keys):
            for rank, proc in self.procs.items():
                if proc.poll() is not None:
                    self.kill()
                    raise RankFailure(f"rank {rank} exited with code {proc.returncode} before joining "
                                      "(its error is logged above)")
            if time.monotonic() > deadline:
                self.kill()
                raise RankFailure(f"ranks did not join within distributed_timeout_s={self.timeout_s:g} s")
            time.sleep(_POLL_S / 4)

    def supervise(self) -> None:
        threading.Thread(target=self._watch, name="rank-watch", daemon=True).start()

    def _watch(self) -> None:
        while not self._stopping:
            for rank, proc in self.procs.items():
                if proc.poll() is not None and not self._stopping:
                    self.failure = f"rank {rank} (pid {proc.pid}) exited with code {proc.returncode}"
                    logger.error("parallel: %s; stopping the other ranks", self.failure)
                    self.kill()
                    if self.on_death is not None:
                        self.on_death(rank, proc.returncode)
                    return
            time.sleep(_POLL_S)

    def watch_death(self, on_death: Callable[[int, int | None], None]) -> None:
        """Call `on_death(rank, exit code)` when a rank exits, at once if one already has."""
        self.on_death = on_death
        for rank, proc in self.procs.items():
            if self.failure is not None and proc.poll() is not None:
                on_death(rank, proc.returncode)
                return

    def failed(self, error: Exception, what: str, wait_s: float = 2.0) -> RankFailure:
        """The failure behind a broken collective: which rank exited, once the OS says so (a peer's reset
        connection usually arrives before its exit status)."""
        deadline = time.monotonic() + wait_s
        while self.failure is None and time.monotonic() < deadline:
            for rank, proc in self.procs.items():
                if proc.poll() is not None:
                    self.failure = f"rank {rank} (pid {proc.pid}) exited with code {proc.returncode}"
                    break
            else:
                time.sleep(0.02)
        if self.failure is not None:
            return RankFailure(f"the engine lost a rank: {self.failure}")
        return RankFailure(f"{what}: {str(error).splitlines()[0]}")

    def check(self) -> None:
        if self.failure is not None:
            raise RankFailure(f"the engine lost a rank: {self.failure}")

    def kill(self) -> None:
        import torch

        self._stopping = True
        torch.set_num_threads(self._threads_before)
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            proc.wait()

    def stop(self) -> None:
        """End every child: they were told STOP already when the engine shut down cleanly."""
        import torch

        self._stopping = True
        torch.set_num_threads(self._threads_before)
        deadline = time.monotonic() + _STOP_WAIT_S
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
