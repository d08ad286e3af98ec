"""pd-kv-hits over synthetic log lines in every accepted format (real node logs: tests/cluster/test_stores.py)."""
from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from pdserve.connectors.kv_hits import KVHitReport, main, parse_line

PREFIX = "2025-01-01 10:00:00,123 INFO connectors.store_connector: "
DECODE_LOG = [
    PREFIX + "Reqid: cmpl-1, Total tokens 600, Local computed tokens: 288, KV hit tokens: 512, need to load: 224",
    PREFIX + "Reqid: cmpl-1, Retrieved 256 tokens from token 256 (chunk-aligned; 224 needed, 32 already local) "
             "of 600 total. size: 0.0040 GB, cost 2.0 ms, throughput: 2.0 GB/s",
    PREFIX + "some unrelated line about Reqid handling",
    PREFIX + "Reqid: cmpl-2, Total tokens 100, Local computed tokens: 0, KV hit tokens: 96, need to load: 96",
    PREFIX + "Reqid: cmpl-2, KV load failed (chunk 0 layer 3: checksum mismatch (corrupt)); recomputing 96 tokens",
    PREFIX + "Reqid: cmpl-3, Total tokens 50, Local computed tokens: 0, KV hit tokens: 0, need to load: 0",
    PREFIX + "Reqid: cmpl-4, Total tokens 300, Local computed tokens: 0, KV hit tokens: 256, need to load: 256",
    PREFIX + "Reqid: cmpl-4, Retrieved 256 tokens from token 0 (chunk-aligned; 256 needed, 0 already local) "
             "of 300 total. size: 0.0040 GB, cost 1.0 ms, throughput: 4.0 GB/s",
]
PREFILL_LOG = [
    PREFIX + "Reqid: cmpl-1, Stored 600 tokens [0, 600) of 600 (skip_leading_tokens=0). "
             "size: 0.0093 GB, cost 3.5 ms, throughput: 2.65 GB/s",
]
LMCACHE_LOG = [
    "[2025-01-01 10:00:00,000] LMCache INFO: Reqid: chat-9, Total tokens 512, LMCache hit tokens: 256, "
    "need to load: 256 (vllm_v1_adapter.py:1)",
    "[2025-01-01 10:00:00,000] LMCache INFO: [req_id=chat-9] Retrieved 256 out of 256 required tokens "
    "(from 512 total tokens). size: 0.0312 gb, cost 12.5000 ms, throughput: 2.5000 GB/s; (cache_engine.py:1)",
    "[2025-01-01 10:00:00,000] LMCache INFO: [req_id=chat-8] Stored 512 out of total 512 tokens. "
    "size: 0.0625 GB, cost 10.0 ms, throughput: 6.1 GB/s; offload_time: 1.0 ms, put_time: 2.0 ms",
]


def test_parse_each_event_kind():
    lookup = parse_line(DECODE_LOG[0])
    assert (lookup.kind, lookup.request_id) == ("lookup", "cmpl-1")
    assert lookup.values == {"total": 600, "local": 288, "hit": 512, "need": 224}
    load = parse_line(DECODE_LOG[1])
    assert load.kind == "load" and load.values["retrieved"] == 256 and load.values["start"] == 256
    assert load.values["gb"] == pytest.approx(0.004) and load.values["gbps"] == pytest.approx(2.0)
    assert parse_line(DECODE_LOG[2]) is None
    fb = parse_line(DECODE_LOG[4])
    assert fb.kind == "fallback" and fb.values["reason"] == "chunk 0 layer 3: checksum mismatch (corrupt)"
    save = parse_line(PREFILL_LOG[0])
    assert save.kind == "save" and save.values["stored"] == 600 and save.values["skip"] == 0
    assert parse_line("Reqid: a,b, Total tokens 5, Local computed tokens: 0, KV hit tokens: 0, "
                      "need to load: 0").request_id == "a,b"


def test_parse_lmcache_native_lines():
    kinds = [(e.kind, e.request_id) for e in map(parse_line, LMCACHE_LOG)]
    assert kinds == [("lookup", "chat-9"), ("load", "chat-9"), ("save", "chat-8")]


def test_report_merges_prefill_and_decode_logs():
    report = KVHitReport()
    report.feed(DECODE_LOG + PREFILL_LOG)
    r1 = report.requests["cmpl-1"]
    assert (r1.total_tokens, r1.local_computed, r1.hit_tokens, r1.need_to_load, r1.retrieved, r1.stored) == \
        (600, 288, 512, 224, 256, 600)
    assert (r1.loaded, r1.recomputed) == (224, 88)
    r2 = report.requests["cmpl-2"]
    assert r2.fallback and (r2.loaded, r2.recomputed) == (0, 100)
    s = report.summary()
    assert s["prompt_tokens"] == 1050 and s["hit_tokens"] == 864
    assert s["hit_rate"] == pytest.approx(864 / 1050)
    assert (s["loaded_tokens"], s["recomputed_tokens"]) == (480, 1050 - 288 - 480)
    assert (s["load_gbps_p50"], s["load_gbps_p99"]) == (2.0, 4.0)
    assert s["fallbacks"] == 1


def test_cli_table_json_and_stdin(tmp_path, capsys):
    decode, prefill = tmp_path / "decode.log", tmp_path / "prefill.log"
    decode.write_text("\n".join(DECODE_LOG) + "\n")
    prefill.write_text("\n".join(PREFILL_LOG) + "\n")
    assert main([str(decode), str(prefill)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:3] == ["request", "id", "total"]
    assert "hit rate: 82.3% of 1050 prompt tokens" in out and "fallbacks: 1 (chunk 0 layer 3" in out
    assert main(["--json", str(decode)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["request_id"] for r in data["requests"]] == ["cmpl-1", "cmpl-2", "cmpl-3", "cmpl-4"]
    proc = subprocess.run([sys.executable, "-m", "pdserve.connectors.kv_hits", "--json", "-"], input="\n".join(LMCACHE_LOG),
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["summary"]["loaded_tokens"] == 256


def test_cli_missing_file_is_one_line_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pdserve.connectors.kv_hits", str(tmp_path / "nope.log")],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0 and proc.stderr.strip().count("\n") == 0 and "cannot read" in proc.stderr


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_follow_prints_rows_as_lines_arrive(tmp_path, stop):
    log = tmp_path / "decode.log"
    log.write_text(DECODE_LOG[0] + "\n")
    # SIGINT ignored as `nohup ... &` leaves it: --follow must still end with its summary.
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.connectors.kv_hits", "--follow", str(log)],
                            stdout=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        assert proc.stdout.readline().split()[:4] == ["cmpl-1", "600", "288", "512"]
        with log.open("a") as f:
            f.write(DECODE_LOG[1] + "\n")
        assert proc.stdout.readline().split()[5] == "256"  # retrieved, after the append
    finally:
        proc.send_signal(stop)
        out, _ = proc.communicate(timeout=10)
    assert "requests: 1" in out and proc.returncode == 0


def test_lmcache_connector_native_and_section5_lines_count_once():
    # The LMCache connector logs LMCache's native line and then the section-5 line for the same transfer.
    report = KVHitReport()
    report.feed([LMCACHE_LOG[0], LMCACHE_LOG[1],
                 "Reqid: chat-9, Retrieved 256 tokens from token 0 (chunk-aligned; 256 needed, 0 already local) "
                 "of 512 total. size: 0.0312 GB, cost 12.0 ms, throughput: 2.6 GB/s", LMCACHE_LOG[1]])
    r = report.requests["chat-9"]
    assert (r.retrieved, r.loads, r.load_ms) == (256, 1, 12.0)


def test_parses_what_the_connectors_print():
    """The connectors' own line builders (connectors.kv_log), so a wording change cannot drift silently."""
    from pdserve.connectors.chunk_math import LoadPlan
    from pdserve.connectors.kv_log import fallback_line, load_line, lookup_line, save_line

    plan = LoadPlan(num_tokens=600, num_local=288, hit=512, chunk_size=256)
    report = KVHitReport()
    report.feed([PREFIX + lookup_line("r-1", plan), PREFIX + load_line("r-1", plan, 4_000_000, 0.002),
                 PREFIX + save_line("r-1", 0, 600, 600, 0, 9_000_000, 0.004),
                 PREFIX + fallback_line("r-2", "timeout: no answer within 1s", 99)])
    r = report.requests["r-1"]
    assert (r.total_tokens, r.local_computed, r.hit_tokens, r.need_to_load) == (600, 288, 512, 224)
    assert (r.retrieved, r.stored, r.loaded) == (256, 600, 224)
    assert r.load_gbps == pytest.approx(2.0, rel=0.05)
    assert report.requests["r-2"].fallback == "timeout: no answer within 1s"
