"""The hand-off across a shaped network link (benchmarks/link.py, benchmarks/kv_link.py), run for real.

Two network namespaces joined by a veth pair whose store end `tc` shapes to 1 Gbit/s: the link really
caps a plain transfer at its rate, and a decode engine in one namespace loading KV from redis-server in
the other answers exactly as recomputing does (greedy, every stored codec that is lossless), through
the same benchmark command a user runs. Timing figures are not asserted: only that the shaping holds
and the load moved the KV over the link.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.link import Link, Shape, start_sender

pytestmark = pytest.mark.netns
ROOT = Path(__file__).resolve().parents[1]
RATE_GBIT = 1.0


def test_shaped_link_caps_a_plain_transfer_at_its_rate():
    with Link() as link:
        sender = start_sender(link, 7002)
        try:
            time.sleep(0.5)
            assert link.shape(Shape(RATE_GBIT)) in ("netem", "tbf")
            nbytes = 24 << 20
            probe = [sys.executable, "-c", "import sys; from benchmarks.link import plain_transfer as t; "
                     f"print({nbytes} / t('{link.store_address}', 7002, {nbytes}, repeats=2))"]
            out = subprocess.run(link.exec_argv(link.decode_ns, probe), capture_output=True, text=True,
                                 timeout=120, cwd=ROOT)
            assert out.returncode == 0, out.stderr[-2000:]
            rate = float(out.stdout.strip()) * 8 / 1e9
            # the shaped rate is a cap (tbf's burst lets a little over through at start); far below it means
            # the shaping (or the probe) is broken
            assert 0.5 * RATE_GBIT < rate < 1.15 * RATE_GBIT, f"{rate:.2f} Gbit/s over a {RATE_GBIT} Gbit/s link"
            # unshaped, the same veth carries far more: the cap came from tc, not from this machine
            link.shape(Shape(None))
            out = subprocess.run(link.exec_argv(link.decode_ns, probe), capture_output=True, text=True,
                                 timeout=120, cwd=ROOT)
            assert float(out.stdout.strip()) * 8 / 1e9 > 2 * RATE_GBIT
        finally:
            sender.kill()
            sender.wait(timeout=10)


def test_kv_link_benchmark_loads_exactly_across_the_link(tmp_path):
    out = tmp_path / "kv_link.json"
    proc = subprocess.run([sys.executable, "benchmarks/kv_link.py", "--model", "tiny", "--lengths", "300",
                           "--rates", str(RATE_GBIT), "--delays", "0", "--codecs", "raw", "--repeats", "1",
                           "--load-tokens", "300", "--json", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["agreement"]["redis/raw"][0] == result["agreement"]["redis/raw"][1]
    shaped = [row for row in result["settings"] if row["rate_gbit"] == RATE_GBIT]
    assert len(shaped) == 1, result["settings"]
    row = shaped[0]
    unshaped = [r for r in result["settings"] if r["rate_gbit"] is None][0]
    assert row["ceiling_gbps"] < unshaped["ceiling_gbps"]  # the shaped setting really was another link
    cell = row["ttft"]["redis/raw"]["300"]
    assert cell["bytes"] > 0 and cell["load_gbps"] > 0
    assert "goal (raw load only" in proc.stdout and "unshaped veth" in proc.stdout
