"""benchmarks/fleet_sim.py at its smallest (a few seconds): it runs the real Router, KVIndex and planner over the
simulated nodes and writes its figures. Structure only, never a time (benchmarks are not timed tests)."""
from __future__ import annotations

import json
import subprocess
import sys

from pdserve.deploy.processes import REPO


def test_fleet_sim_runs_and_reports(tmp_path):
    cmd = [sys.executable, str(REPO / "benchmarks" / "fleet_sim.py"), "--sizes", "8", "--goodput-sizes", "4",
           "--duration", "10", "--goodput-duration", "60", "--shift-loads", "0.5", "--plot", str(tmp_path / "fleet.png")]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("machine: ")
    result = json.loads((tmp_path / "bench-results" / "fleet_sim.json").read_text())
    assert [r["trace"] for r in result["routing"]] == ["chat-poisson", "docqa-bursty"]
    for r in result["routing"]:
        assert r["requests"] > 0 and r["index_chunks"] > 0 and r["index_bytes"] > 0
        assert 0 < r["route_p50_us"] <= r["route_p99_us"]
        assert 0 <= r["hit_index"] <= 1 and 0 <= r["hit_lookup"] <= 1
    (g,) = result["goodput"]
    assert sorted(g["by_split"]) == ["1", "2", "3"] and g["best"] >= g["one_to_one"]
    assert set(g["planner"]) <= {"defaults", "previous"}
    assert (tmp_path / "fleet.png").stat().st_size > 0
