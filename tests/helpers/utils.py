"""Test helpers shared by every test module: free ports, console scripts and a real redis-server."""
from __future__ import annotations

import shutil
import subprocess

from pdserve.deploy.processes import console_script, free_port  # noqa: F401  (re-exported for the tests)
from pdserve.deploy.processes import wait_for_port as port_open


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
