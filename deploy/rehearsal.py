"""Run the command lines of the deploy files as local processes: a rehearsal of a deployment.

    python -m pdserve.deploy.rehearsal compose [deploy/compose.yaml]
    python -m pdserve.deploy.rehearsal kubernetes [deploy/kubernetes]

deploy.manifests turns every container of `deploy/compose.yaml` or `deploy/kubernetes/*.yaml` into
a Step: its command line with the flags it is written with, translated for one host. This module
starts the steps in dependency order (compose depends_on; init containers before their pod's
containers, which Kubernetes does not otherwise order: an exited container is restarted, as the
kubelet would) and calls a step up when the file's own health check passes (compose `healthcheck`, Kubernetes readiness probe); once all are up, every
other probe of the file (startup, liveness) must pass too. tests/deploy/test_files.py runs both
files this way.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.common import env
from pdserve.deploy.processes import HOST, Child

MAX_RESTARTS = 3


@dataclass
class Probe:
    """One health check of the file (exec, HTTP GET or TCP connect), localized."""

    kind: str  # exec | http | tcp
    argv: list[str] = field(default_factory=list)
    port: int = 0
    path: str = "/"

    def ok(self, timeout_s: float = 3.0) -> bool:
        if self.kind == "exec":
            try:
                return subprocess.run(self.argv, capture_output=True, timeout=timeout_s + 10).returncode == 0
            except subprocess.TimeoutExpired:
                return False
        if self.kind == "http":
            try:
                with urllib.request.urlopen(f"http://{HOST}:{self.port}{self.path}", timeout=timeout_s) as r:
                    return 200 <= r.status < 400
            except (urllib.error.URLError, OSError):
                return False
        try:
            socket.create_connection((HOST, self.port), timeout=timeout_s).close()
            return True
        except OSError:
            return False


@dataclass
class Step:
    """One container's command line, ready to run here."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    probes: list[Probe] = field(default_factory=list)  # the first decides "up"; all must pass once up
    one_shot: bool = False  # must exit 0 (an init container, a compose job) before its dependents start
    after: list[str] = field(default_factory=list)
    ports: dict[int, int] = field(default_factory=dict)  # container port -> local port
    source: list[str] = field(default_factory=list)  # the command line as the file states it (expanded)
    restart: bool = False  # restarted when it exits, like a Kubernetes container (e.g. its store was not up yet)


# ------------------------------------------------------------------ running

class Rehearsal:
    """Starts steps as their dependencies allow, until every long-running one is up."""

    def __init__(self, steps: list[Step], log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.steps = {s.name: s for s in steps}
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.env = env or {}
        self.children: dict[str, Child] = {}
        self.up: set[str] = set()
        self.restarts: dict[str, int] = {}
        self.up_after_s: dict[str, float] = {}  # seconds from start() until each step was up (or done)
        self._t0 = time.monotonic()

    def _ready(self, name: str) -> bool:
        if name in self.up:
            return True
        step, child = self.steps[name], self.children.get(name)
        if child is None:
            return False
        if step.one_shot:
            if child.proc.poll() is None:
                return False
            if child.proc.returncode != 0:
                raise RuntimeError(f"{name} exited with {child.proc.returncode}:\n{child.tail()}")
        elif not child.alive:
            self.restarts[name] = self.restarts.get(name, 0) + 1
            if not step.restart or self.restarts[name] > MAX_RESTARTS:
                raise RuntimeError(f"{name} exited with {child.proc.returncode}:\n{child.tail()}")
            time.sleep(1.0)  # kubelet backs off too
            child.start()
            return False
        elif step.probes and not step.probes[0].ok():
            return False
        self.up.add(name)
        self.up_after_s[name] = time.monotonic() - self._t0
        return True

    def start(self, timeout_s: float = 180.0, on_up: Callable[[str], None] | None = None) -> None:
        self._t0 = time.monotonic()
        deadline = self._t0 + timeout_s
        try:
            while not all(self._ready(n) for n in self.steps):
                for name, step in self.steps.items():
                    if name not in self.children and all(self._ready(d) for d in step.after):
                        child = Child(name, step.argv, self.log_dir, {**self.env, **step.env})
                        child.start()
                        self.children[name] = child
                if time.monotonic() > deadline:
                    waiting = [n for n in self.steps if n not in self.up]
                    raise RuntimeError(f"not up after {timeout_s:.0f}s: {waiting}")
                time.sleep(0.2)
            for name, step in self.steps.items():  # every probe of the file passes once up (liveness too)
                for probe in step.probes:
                    if not step.one_shot and not probe.ok():
                        raise RuntimeError(f"{name}: probe {probe} fails while the step is up")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for child in reversed(list(self.children.values())):
            child.terminate()
        for child in reversed(list(self.children.values())):
            child.stop()


def main(argv: list[str] | None = None) -> int:
    import argparse
    import tempfile

    p = argparse.ArgumentParser(prog="python -m pdserve.deploy.rehearsal", description=__doc__.split("\n")[0])
    p.add_argument("kind", choices=("compose", "kubernetes"))
    p.add_argument("path", nargs="?", default=None)
    args = p.parse_args(argv)
    from pdserve.deploy.manifests import REPO, compose_steps, kubernetes_steps

    workdir = Path(tempfile.mkdtemp(prefix="pdserve-rehearsal-"))
    path = Path(args.path or REPO / "deploy" / ("compose.yaml" if args.kind == "compose" else "kubernetes"))
    steps = compose_steps(path, workdir, dict(os.environ)) if args.kind == "compose" else \
        kubernetes_steps(path, workdir)
    rehearsal = Rehearsal(steps, workdir / "logs", {env.CACHE_DIR.name: str(workdir / "cache")})
    rehearsal.start()
    for step in steps:
        print(f"{step.name}: up after {rehearsal.up_after_s[step.name]:.1f} s, ports {step.ports}; "
              f"log {workdir / 'logs' / step.name}.out", flush=True)
    try:
        while all(c.alive for n, c in rehearsal.children.items() if not rehearsal.steps[n].one_shot):
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        rehearsal.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
