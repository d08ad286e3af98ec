"""Test helpers shared by every test module: free ports, console scripts and a real redis-server."""
from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from deploy.processes import free_port
from deploy.processes import wait_for_port as port_open


REPO = Path(__file__).resolve().parent.parent


def console_script(name: str) -> list[str]:
    """argv that runs the console script `name` as this checkout's pyproject.toml declares it.

    The venv's bin/ wrappers are written at install time and go stale when an entry point moves;
    this runs the declared `module:function` on the code under test, with argv[0] set to `name`.
    """
    with open(REPO / "pyproject.toml", "rb") as f:
        target = tomllib.load(f)["project"]["scripts"][name]
    module, func = target.split(":")
    code = f"import sys; sys.argv[0] = {name!r}; from {module} import {func}; sys.exit({func}())"
    return [sys.executable, "-c", code]


def wait_for_port(port: int, timeout: float = 30.0, host: str = "127.0.0.1") -> None:
    if not port_open(port, timeout, host):
        raise TimeoutError(f"nothing listening on {host}:{port} after {timeout}s")


class RedisServer:
    """A real redis-server on a free port, without persistence; stop() and start() for fault tests."""

    def __init__(self) -> None:
        exe = shutil.which("redis-server")
        assert exe, "redis-server is not installed (make test installs it)"
        self.exe = exe
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port(self.port)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None
