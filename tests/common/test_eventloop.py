"""common/eventloop.py: which loop a process runs on, and the opt-out that picks asyncio's own."""
from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import pytest

from pdserve.common import eventloop
from pdserve.deploy.processes import console_script
from pdserve.deploy.server_process import ServerProcess


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_uvloop_by_default(monkeypatch):
    monkeypatch.delenv(eventloop.ENV, raising=False)
    assert eventloop.loop_kind() == "uvloop"
    assert eventloop.run(_loop_module()).startswith("uvloop")


def test_asyncio_on_request(monkeypatch):
    monkeypatch.setenv(eventloop.ENV, "asyncio")
    assert eventloop.run(_loop_module()).startswith("asyncio")


def test_unknown_loop_is_refused(monkeypatch):
    monkeypatch.setenv(eventloop.ENV, "trio")
    with pytest.raises(ValueError, match="PDSERVE_EVENT_LOOP must be one of uvloop, asyncio, got 'trio'"):
        eventloop.loop_kind()


@pytest.mark.parametrize("prog,args", [("pd-proxy", ["--decode", "127.0.0.1:1"]), ("pd-serve", []),
                                       ("pd-decode", ["--kv-store", "file:///nonexistent"])])
@pytest.mark.slow  # seconds: outside make test-quick
def test_processes_refuse_an_unknown_loop_in_one_line(prog, args):
    proc = subprocess.run([*console_script(prog), *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, eventloop.ENV: "trio"})
    assert proc.returncode == 1, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: PDSERVE_EVENT_LOOP must be one of"), proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["uvloop", "asyncio"])
def test_pd_serve_runs_on_the_chosen_loop(tiny_llama, monkeypatch, kind):
    """Nodes and pd-serve share run_node: uvloop's extension is loaded in the serving process only when
    it runs on uvloop (it is imported only then)."""
    monkeypatch.setenv(eventloop.ENV, kind)
    with ServerProcess("--model", str(tiny_llama), "--kv-cache-memory", "64MiB") as server:
        maps = Path(f"/proc/{server.proc.pid}/maps").read_text()
    assert ("/uvloop/loop." in maps) == (kind == "uvloop")
