"""A real `pd-serve` process (tests, benchmarks): started on a free port (--port 0), ready when it logs its URL."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from pdserve.deploy.processes import console_script, wait_or_kill

PD_SERVE = console_script("pd-serve")
_READY = re.compile(r"ready at (http://[\d.]+:\d+)")


class ServerProcess:
    """`pd-serve` with the given arguments; its combined output goes to a log file the tests can read."""

    def __init__(self, *args: str, exe: list[str] = PD_SERVE) -> None:
        self.argv = [*exe, "--port", "0", *args]
        self.log_path = Path(tempfile.mkstemp(prefix="pd-serve-", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self, timeout: float = 90.0) -> ServerProcess:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = _READY.search(self.log)
            if m:
                self.url = m.group(1)
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"pd-serve exited with {self.proc.returncode}:\n{self.log}")
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"pd-serve not ready after {timeout}s:\n{self.log}")

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Signal the server and wait for it; returns its exit status."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            wait_or_kill(self.proc, timeout)
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -------------------------------------------------------- small sync HTTP helpers

    def request(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
                timeout: float = 60.0) -> tuple[int, dict[str, str], bytes]:
        """(status, headers, body) without raising on HTTP errors; `body` is JSON-encoded unless bytes."""
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, dict(r.headers), r.read()
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), e.read()

    def get_json(self, path: str) -> Any:
        status, _, body = self.request("GET", path)
        assert status == 200, (status, body)
        return json.loads(body)

    def wait_for(self, predicate, what: str, timeout: float = 60.0, path: str = "/stats") -> Any:
        """Poll a JSON endpoint until predicate(json) holds; returns that json."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.get_json(path)
            if predicate(value):
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; last {path}: {value}")
            time.sleep(0.02)
