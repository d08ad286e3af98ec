"""pd-kvstore: stats/ls/verify/clear on both backends; clean one-line errors with a non-zero exit."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from pdserve.kvstore.cli import main
from tests.helpers.kvstore import FP, OTHER_FP, PYTHON, make_chunks, open_test_store, write_all

REPO = Path(__file__).resolve().parents[2]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "pdserve.kvstore.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=60)


def _fill(url: str) -> None:
    keys, layers = make_chunks(40, 2, torch.bfloat16)  # 3 chunks, 6 objects per fingerprint
    write_all(open_test_store(url, 2, torch.bfloat16), keys, layers)
    other = open_test_store(url, 2, torch.bfloat16, fingerprint=OTHER_FP)
    other.put_layer(0, layers[0])  # uncommitted: objects but no chunks


@pytest.mark.slow  # seconds: outside make test-quick
def test_file_store_stats_ls_verify_clear(tmp_path, capsys):
    url = f"file://{tmp_path}"
    _fill(url)
    done = _cli(url, "stats")  # the real entry point, once
    assert done.returncode == 0, done.stderr
    assert FP in done.stdout and "total: 2 fingerprint(s), 3 committed chunk(s)" in done.stdout
    capsys.readouterr()

    assert main([url, "stats", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats[FP]["chunks"] == 3 and stats[FP]["objects"] == 6 and stats[OTHER_FP]["chunks"] == 0
    assert stats[FP]["bytes"] == sum(p.stat().st_size for p in (tmp_path / FP).rglob("*.kv"))
    assert main([url, "ls", "--fingerprint", OTHER_FP]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and all("partial" in line and " 1 layers" in line for line in lines)
    assert main([url, "verify"]) == 0
    assert "verified 9 object(s)" in capsys.readouterr().out

    victim = next((tmp_path / FP).rglob("1.kv"))
    raw = bytearray(victim.read_bytes())
    raw[-1] ^= 0xFF
    victim.write_bytes(raw)
    assert main([url, "verify"]) == 1
    out = capsys.readouterr().out
    assert f"CORRUPT {victim}: checksum mismatch" in out and "1 corrupt" in out

    assert main([url, "clear", "--fingerprint", OTHER_FP]) == 0
    assert "removed 3 object(s)" in capsys.readouterr().out
    assert main([url, "clear"]) == 0
    assert main([url, "stats", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == {}


def test_verify_reports_an_object_under_another_chunks_key(tmp_path, capsys):
    url = f"file://{tmp_path}"
    _fill(url)
    objects = sorted((tmp_path / FP).rglob("0.kv"), key=lambda p: p.stat().st_size)
    first, second = objects[-2:]  # layer 0 of the two full 16-token chunks (the third has 8 tokens)
    second.write_bytes(first.read_bytes())
    assert main([url, "verify", "--fingerprint", FP]) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"CORRUPT {second}: a valid object of another chunk or layer, stored under the wrong key",
        f"verified 6 object(s), {sum(p.stat().st_size for p in (tmp_path / FP).rglob('*.kv'))} bytes: 1 corrupt, 0 damaged chunk(s)"]


def test_redis_store_stats_and_verify(redis_server, capsys):
    _fill(redis_server.url)
    assert main([redis_server.url, "stats", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert (stats[FP]["chunks"], stats[FP]["objects"], stats[OTHER_FP]["objects"]) == (3, 6, 3)
    assert main([redis_server.url, "verify", "--fingerprint", FP]) == 0
    assert "verified 6 object(s)" in capsys.readouterr().out
    assert main([redis_server.url, "clear"]) == 0
    assert "removed 9 object(s)" in capsys.readouterr().out


@pytest.mark.slow  # seconds: outside make test-quick
def test_unreachable_store_and_bad_url_are_one_line_errors(redis_server):
    redis_server.stop()
    done = _cli(redis_server.url, "stats", "--timeout", "1")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("pd-kvstore: error: redis") and "unreachable" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert main(["ftp://host/x", "ls"]) == 2


@pytest.mark.parametrize("path,fragment", [
    ("/abc", "redis URL path must be a database number (redis://host:port/0), got '/abc'"),
    ("/0/1", "redis URL path must be a database number (redis://host:port/0), got '/0/1'"),
    ("/-1", "redis URL path must be a database number (redis://host:port/0), got '/-1'"),
])
def test_a_redis_url_whose_path_is_no_database_is_refused(redis_server, path, fragment):
    """redis-py reads `redis://host/abc` as database 0: against a real server that answers, pd-kvstore refuses
    the URL (one line, exit 2) instead of using db 0."""
    url = redis_server.url.removesuffix("/0") + path
    done = _cli(url, "stats")
    assert done.returncode == 2 and done.stdout == "", done.stdout
    assert done.stderr.strip().splitlines() == [f"pd-kvstore: error: {fragment} in {url!r}"]


@pytest.mark.parametrize("port,reason", [("abc", "Port could not be cast to integer value as 'abc'"),
                                         ("70000", "Port out of range 0-65535")])
def test_a_redis_url_whose_port_is_no_port_names_the_url(port, reason):
    url = f"redis://127.0.0.1:{port}/0"
    done = _cli(url, "stats")
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"pd-kvstore: error: bad port in {url!r}: {reason}"]
