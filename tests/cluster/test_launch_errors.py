"""The launchers' failure modes: a bad flag, an unreachable store or an unreadable model is one line on
stderr and a non-zero exit, before any weights are loaded."""
from __future__ import annotations

import os
import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pdserve.deploy.processes import console_script, free_port


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([*console_script(argv[0]), *argv[1:]], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("argv,code,needle", [
    (("pd-prefill", "--bogus"), 2, "unrecognized arguments: --bogus"),
    (("pd-decode", "--grpc-port", "x"), 2, "--grpc-port"),
    (("pd-decode", "--kv-store", "redis://127.0.0.1:{port}/0"), 1, "unreachable"),
    (("pd-prefill", "--kv-store", "lm://127.0.0.1:{port}"), 1, "LMCache server 127.0.0.1:"),
    (("pd-prefill", "--kv-store", "s3://bucket"), 1, "unsupported KV store URL"),
    (("pd-decode", "--lmcache-config", "/nonexistent/lmcache.yaml"), 1, "cannot read LMCache config"),
    (("pd-prefill", "--model", "/nonexistent/model"), 1, "does not exist"),
    (("pd-proxy", "--prefill", "127.0.0.1:1"), 2, "--decode"),
    (("pd-proxy", "--decode", "nohost"), 2, "expected HOST:PORT"),
    (("pd-proxy", "--decode", "127.0.0.1:1", "--policy", "random"), 2, "--policy"),
    (("pd-proxy", "--decode", "127.0.0.1:1", "--stall-timeout", "0.5"), 1, "must exceed the nodes' heartbeat"),
    (("pd-proxy", "--decode", "127.0.0.1:1", "--token-timeout", "0"), 1,
     "--token-timeout must be a positive number of seconds"),
    (("pd-kv-hits", "/nonexistent.log"), 1, "cannot read /nonexistent.log"),
])
@pytest.mark.slow  # seconds: outside make test-quick
def test_launcher_errors_are_one_line(tmp_path, argv, code, needle):
    argv = tuple(a.format(port=free_port()) for a in argv)
    if argv[0] in ("pd-prefill", "pd-decode") and "--kv-store" not in argv:
        argv += ("--kv-store", (tmp_path / "kv").as_uri())
    proc = _run(*argv)
    assert proc.returncode == code, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and lines[0].startswith(f"{argv[0]}: error: "), proc.stderr


@pytest.mark.parametrize("flag", ["--grpc-port", "--port"])
@pytest.mark.slow  # seconds: outside make test-quick
def test_a_port_a_running_node_holds_stops_a_second_node(tmp_path, tiny_llama, flag):
    """A gRPC server's port as grpc binds it by default (SO_REUSEPORT, as a node's was): a second node given
    that port as its gRPC or HTTP port stops with one line, where it used to share the port and say ready."""
    holder = grpc.server(ThreadPoolExecutor(1))
    port = holder.add_insecure_port("127.0.0.1:0")
    holder.start()
    try:
        other = "--port" if flag == "--grpc-port" else "--grpc-port"
        proc = _run("pd-decode", "--model", str(tiny_llama), flag, str(port), other, "0",
                    "--kv-store", (tmp_path / "kv").as_uri())
    finally:
        holder.stop(None)
    lines = [line for line in proc.stderr.strip().splitlines() if " INFO " not in line]  # the store's bound
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-3000:]
    what = " (gRPC)" if flag == "--grpc-port" else ""
    assert lines[0].startswith(f"pd-decode: error: cannot listen on 127.0.0.1:{port}{what}: Address already in use"), \
        lines


def test_free_ports_stay_out_of_the_kernels_ephemeral_range():
    """Outgoing connections take ports from the ephemeral range, so a port picked there could be
    gone before the child binds it (CI once saw a decode node fail to listen that way)."""
    from pdserve.deploy.processes import _ephemeral_range

    low, high = _ephemeral_range()
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(10000 <= p < low for p in ports), [p for p in ports if not 10000 <= p < low]
    with socket.socket() as s:  # each is bindable right now
        s.bind(("127.0.0.1", ports[-1]))


def test_free_ports_come_from_the_launchers_range(monkeypatch):
    """PDSERVE_PORT_RANGE keeps launchers side by side (the suite's xdist workers) on disjoint ports."""
    from tests.helpers.workers import claim_port_range

    monkeypatch.setenv("PDSERVE_PORT_RANGE", "23000-23049")
    ports = {free_port() for _ in range(40)}
    assert len(ports) == 40 and all(23000 <= p <= 23049 for p in ports), sorted(ports)
    for bad in ("23000", "x-y", "900-1000", "30000-20000"):
        monkeypatch.setenv("PDSERVE_PORT_RANGE", bad)
        with pytest.raises(ValueError, match="PDSERVE_PORT_RANGE"):
            free_port()
    ranges = []
    for worker in ("gw0", "gw1", "gw2"):
        monkeypatch.delenv("PDSERVE_PORT_RANGE")
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
        claim_port_range()
        low, high = map(int, os.environ["PDSERVE_PORT_RANGE"].split("-"))
        ranges.append(range(low, high + 1))
    assert all(len(r) > 1000 for r in ranges)
    assert not set(ranges[0]) & set(ranges[1]) and not set(ranges[1]) & set(ranges[2])
