"""pd-serve start-up failures: one line on stderr, non-zero exit, no traceback."""
from __future__ import annotations

import socket
import subprocess

import pytest

from tests.serve_helpers import PD_SERVE


def _run(*args: str) -> tuple[int, list[str]]:
    proc = subprocess.run([*PD_SERVE, "--port", "0", *args], capture_output=True, text=True, timeout=120,
                          env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    return proc.returncode, (proc.stdout + proc.stderr).strip().splitlines()


@pytest.mark.parametrize("args,fragment", [
    (["--block-size", "abc"], "--block-size: expected an integer, got 'abc'"),
    (["--max-num-seqs", "0"], "--max-num-seqs: expected an integer >= 1, got 0"),
    (["--dtype", "float8"], "--dtype: invalid choice"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_bad_flag_is_one_line_exit_2(args, fragment):
    rc, lines = _run(*args)
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("pd-serve: error:") and fragment in lines[0]


@pytest.mark.parametrize("args,message", [
    (["--block-size", "3"], "block_size must be a power of two, got 3"),
    (["--kv-cache-memory", "3XB"], "cannot parse a byte size from '3XB' (use e.g. 2GiB, 512MiB, 1000000)"),
])
def test_invalid_engine_option(args, message):
    rc, lines = _run(*args)
    assert rc == 1 and lines == [f"pd-serve: error: invalid engine option: {message}"]


def test_missing_model_dir(tmp_path):
    rc, lines = _run("--model", str(tmp_path / "nope"))
    assert rc == 1 and lines == [f"pd-serve: error: model directory {tmp_path / 'nope'} does not exist or is "
                                 "not a directory"]


def test_model_dir_without_config(tmp_path):
    rc, lines = _run("--model", str(tmp_path))
    assert rc == 1 and lines == [f"pd-serve: error: model directory {tmp_path} is not readable or has no "
                                 "config.json"]


def test_corrupt_model_dir(tmp_path):
    (tmp_path / "config.json").write_text("{ this is not json")
    rc, lines = _run("--model", str(tmp_path))
    assert rc == 1 and len(lines) == 1, lines
    assert lines[0].startswith(f"pd-serve: error: cannot load model from {tmp_path}: ")


def test_port_in_use(tiny_llama):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        rc, lines = _run("--model", str(tiny_llama), "--port", str(s.getsockname()[1]))
    assert rc == 1 and len(lines) == 1 and lines[0].startswith("pd-serve: error: cannot listen on 127.0.0.1:")
