"""The launchers' failure modes: a bad flag, an unreachable store or an unreadable model is one line on
stderr and a non-zero exit, before any weights are loaded."""
from __future__ import annotations

import socket
import subprocess

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
