"""`pd-bench` against a live P/D cluster (real nodes, proxy, file store): every workload, the pacing
modes, prompts sized by the server's /tokenize or --tokenizer (never a guess), the JSON schema, the
plots (prompt tokens by source) and `compare`; the SLO goodput arithmetic on a hand-made trace."""
from __future__ import annotations

import json
import struct
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import jsonschema
import pytest

from pdserve.bench import cli, plots, report, schema, stats
from pdserve.deploy.processes import console_script
from tests.helpers.cluster import start_cluster

pytestmark = pytest.mark.slow

BASE = ["--no-progress", "--ignore-eos", "--no-plots"]


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory):
    c = start_cluster(tiny_llama, tmp_path_factory.mktemp("bench-cluster"))
    yield c
    c.stop()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """One folder for every run of this module, so `compare` can read them all."""
    return tmp_path_factory.mktemp("bench-runs")


def bench(cluster, tiny_llama, out: Path, *args: str) -> dict:
    """One run; sized with the model's own tokenizer, or with the server's when `tiny_llama` is None."""
    metrics = [a for n in cluster.prefill + cluster.decode
               for a in ("--metrics-url", f"http://127.0.0.1:{n.http_port}/metrics")]
    tokenizer = ["--tokenizer", str(tiny_llama)] if tiny_llama is not None else []
    argv = [*args, *BASE, "--base-url", cluster.url, *tokenizer, "--output-dir", str(out), *metrics]
    assert cli.main(argv) == 0
    label = argv[argv.index("--label") + 1]
    result = json.loads((out / f"{label}.json").read_text())
    schema.validate(result)
    return result


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", path
    return struct.unpack(">II", data[16:24])


def check_timing(r: dict, output_len: int) -> None:
    """Every request: exactly output_len tokens (EOS ignored), output_len - 1 gaps, TTFT + gaps <= E2E."""
    assert r["ok"] and r["status"] == 200 and r["error"] is None
    assert r["output_tokens"] == output_len and len(r["itl"]) == output_len - 1
    assert 0 < r["ttft"] <= r["ttft"] + sum(r["itl"]) <= r["e2e"] + 1e-5


def test_multi_round_qa(cluster, tiny_llama, runs):
    res = bench(cluster, tiny_llama, runs, "multi-round-qa", "--users", "3", "--rounds", "3",
                "--system-prompt-len", "150", "--user-info-len", "60", "--question-len", "12", "--answer-len", "6",
                "--slo-ttft", "30s", "--label", "mrqa")
    reqs = res["requests"]
    assert len(reqs) == 9
    for r in reqs:
        check_timing(r, 6)
    for user in ("user0", "user1", "user2"):
        turns = sorted((r for r in reqs if r["session"] == user), key=lambda r: r["turn"])
        assert [r["turn"] for r in turns] == [0, 1, 2]
        # Each turn's prompt holds the previous one (history grows); it starts after the previous answer.
        assert turns[0]["prompt_tokens"] > 150 + 60
        assert turns[0]["prompt_tokens"] < turns[1]["prompt_tokens"] < turns[2]["prompt_tokens"]
        assert turns[1]["start"] >= turns[0]["start"] + turns[0]["e2e"]
    s = res["summary"]
    assert s["completed"] == 9 and s["failed"] == 0 and s["output_tokens"] == 54
    assert s["prompt_tokens"] == sum(r["prompt_tokens"] for r in reqs)
    assert s["cached_tokens"] == sum(r["cached_tokens"] for r in reqs) > 0
    assert s["goodput"]["good_requests"] == 9 and s["goodput"]["slo"]["ttft_ms"] == 30000
    # The decode node loads every prompt from the store the prefill node filled: KV counters moved.
    kv, delta = s["kv"], res["metrics"]["delta"]
    assert kv["store_lookups"] == 9 and kv["store_hit_tokens"] == delta["pdserve_kv_hit_tokens_total"] > 0
    assert 0 < kv["prompt_tokens_computed"] < s["prompt_tokens"]  # the shared prefix is computed once
    assert len(res["metrics"]["urls"]) == 2
    # Where the prompt tokens came from: on P/D each prompt is served by its prefill node (local prefix cache
    # or computed) and again by its decode node (local, store or computed): twice the prompt tokens in all,
    # the store's share real. Usage's cached_tokens counts earlier requests' KV only (the shared prefix and the
    # history, found in the prefill node's prefix cache), never the request's own hand-off to decode.
    sources = stats.prompt_sources(res)
    assert list(sources) == [stats.LOCAL, stats.STORE, stats.COMPUTED]
    assert sum(sources.values()) == 2 * s["prompt_tokens"]
    assert sources[stats.STORE] == kv["store_loaded_tokens"] > 0 and sources[stats.LOCAL] > 0
    assert 0 < s["cached_fraction"] < 1 and s["cached_tokens"] <= sources[stats.LOCAL]
    assert sources[stats.STORE] / sum(sources.values()) < 0.6
    edges, series = stats.prompt_source_series(res)
    assert list(series) == list(sources) and len(edges) - 1 - len(res["metrics"]["timeline"]) in (0, 1)
    assert all((v >= 0).all() for v in series.values()) and series[stats.STORE].max() > 0


def test_long_doc_qa_concurrency(cluster, tiny_llama, runs):
    res = bench(cluster, tiny_llama, runs, "long-doc-qa", "--documents", "2", "--doc-len", "300", "--questions",
                "3", "--question-len", "10", "--answer-len", "4", "--concurrency", "2", "--label", "ldqa")
    reqs = res["requests"]
    assert sorted(r["session"] for r in reqs) == sorted(f"doc{d}-q{q}" for d in range(2) for q in range(3))
    for r in reqs:
        check_timing(r, 4)
    # Never more than 2 in flight: at each start, count the requests already running.
    for r in reqs:
        assert sum(o["start"] <= r["start"] < o["start"] + o["e2e"] for o in reqs) <= 2
    # The later questions on a document find it in the store.
    assert res["summary"]["kv"]["store_hit_tokens"] >= 300 * 2
    assert "at most 2 in flight" in res["load"]["pacing"]


def test_random_qps_completions(cluster, tiny_llama, runs):
    res = bench(cluster, tiny_llama, runs, "random", "--num-requests", "5", "--input-len", "40", "--output-len", "5",
                "--qps", "10", "--arrival", "uniform", "--api", "completions", "--label", "rnd")
    starts = [r["start"] for r in res["requests"]]
    for r in res["requests"]:
        check_timing(r, 5)
        assert r["prompt_tokens"] == 40  # the tokenizer sized the text exactly
    for i, t in enumerate(sorted(starts)):  # uniform arrivals 100 ms apart
        assert t >= i * 0.1 - 0.01
    assert res["endpoint"]["api"] == "completions" and res["workload"]["params"]["input_len"] == 40


def test_prompts_sized_by_the_servers_tokenizer(cluster, runs):
    """No --tokenizer: pd-bench asks the proxy's /tokenize and /detokenize, so 40 tokens are 40 tokens of the
    served model (the byte-level test model: a characters-per-token guess would have sent 160)."""
    res = bench(cluster, None, runs, "random", "--num-requests", "3", "--input-len", "40", "--output-len", "3",
                "--api", "completions", "--label", "rnd-server-tok")
    assert [r["prompt_tokens"] for r in res["requests"]] == [40, 40, 40]
    res = bench(cluster, None, runs, "long-doc-qa", "--documents", "1", "--doc-len", "200", "--questions", "2",
                "--question-len", "8", "--answer-len", "3", "--label", "ldqa-server-tok")
    docs = len("Document 0: ") + 200 + len("\n\nQuestion 1: ") + 8
    assert all(r["ok"] and r["prompt_tokens"] > docs for r in res["requests"])  # plus the chat template


class _NoTokenize(BaseHTTPRequestHandler):
    """A server with /v1/models but no /tokenize (not every OpenAI-compatible server has it)."""

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._send(200, {"data": [{"id": "m"}]}) if self.path == "/v1/models" else self._send(404, {})

    def do_POST(self) -> None:
        self._send(404, {"error": {"message": "not found"}})

    def log_message(self, *args: object) -> None:
        pass


def test_no_tokenizer_anywhere_is_an_error_not_a_guess(tmp_path, capsys):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NoTokenize)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        code = cli.main(["random", "--num-requests", "1", "--base-url", f"http://127.0.0.1:{server.server_port}",
                         "--output-dir", str(tmp_path), *BASE, "--metrics-url", "none"])
    finally:
        server.shutdown()
    err = capsys.readouterr().err
    assert code == 2 and "has no /tokenize" in err and "--tokenizer" in err, err
    assert not list(tmp_path.iterdir())  # nothing was sent or written


def test_replay_trace(cluster, tiny_llama, runs, tmp_path):
    trace = tmp_path / "trace.jsonl"
    lines = [{"timestamp": 100.0, "prompt": "Hello there, how are you?", "max_tokens": 3},
             {"timestamp": 100.3, "prompt_token_ids": [5, 6, 7, 8, 9, 10], "max_tokens": 4},
             {"timestamp": 100.4, "input_len": 30, "output_len": 2},
             {"timestamp": 100.5, "conversations": [{"from": "human", "value": "What is KV caching?"},
                                                    {"from": "gpt", "value": "Stored keys."}]},
             {"timestamp": 100.6, "session": "s1", "prompt": "first turn", "max_tokens": 3},
             {"timestamp": 100.6, "session": "s1", "prompt": "second turn", "max_tokens": 3}]
    trace.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    # Through the console entry point, as a user runs it.
    proc = subprocess.run([*console_script("pd-bench"), "replay", str(trace), *BASE, "--api", "completions",
                           "--base-url", cluster.url, "--tokenizer", str(tiny_llama), "--output-dir", str(runs),
                           "--label", "replay", "--metrics-url", "none"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "requests ok / sent" in proc.stdout and "replay (file=" in proc.stdout
    res = schema.load(runs / "replay.json")
    assert res["metrics"] is None and res["summary"]["kv"] is None
    by_line = sorted(res["requests"], key=lambda r: (r["start"], r["turn"]))
    assert [r["output_tokens"] for r in by_line] == [3, 4, 2, len("Stored keys."), 3, 3]  # byte tokenizer
    assert by_line[1]["prompt_tokens"] == 6 and by_line[2]["prompt_tokens"] == 30
    for r, line in zip(by_line, lines):  # started at the trace's offsets, never before
        assert r["start"] >= line["timestamp"] - 100.0 - 0.005
    s1 = [r for r in res["requests"] if r["session"] == "s1"]
    assert s1[1]["start"] >= s1[0]["start"] + s1[0]["e2e"] and s1[1]["prompt_tokens"] > s1[0]["prompt_tokens"] + 3


def test_compare_and_plots(runs, tmp_path):
    files = [runs / f"{label}.json" for label in ("mrqa", "ldqa", "rnd", "replay")]
    out = tmp_path / "cmp"
    assert cli.main(["compare", *map(str, files), "-o", str(out)]) == 0
    md = (out / "compare.md").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| "))
    assert [c.strip() for c in header.strip("|").split("|")][1:] == ["mrqa", "ldqa", "rnd", "replay"]
    assert "| TTFT p99 (ms) |" in md and "| goodput req/s (TTFT <= 30000 ms) |" in md
    for name in plots.PLOTS:
        path = out / f"compare-{name}.png"
        assert path.stat().st_size > 10_000 and png_size(path) == plots.PLOT_SIZE
    assert png_size(out / "compare-overview.png") == plots.OVERVIEW_SIZE
    # Every run's workload is named, with the labels of the runs that ran it (not the first run's alone).
    results = [schema.load(f) for f in files]
    captions = md.split("\n\n")[0].splitlines()
    assert captions == report.captions(results) and len(captions) == 4
    for line, r in zip(captions, results):
        assert line == f"{r['label']}: {report.describe(r)}"
    twins = [results[2], {**results[2], "label": "rnd-again"}]  # one workload, two runs: one caption
    assert report.captions(twins) == [report.describe(results[2])]
    other = {**results[2], "label": "rnd-40", "workload": {"name": "random", "params": {"input_len": 41}}}
    assert report.captions([results[2], other]) == [f"rnd: {report.describe(results[2])}",
                                                     f"rnd-40: {report.describe(other)}"]


def test_make_bench_pd_pipeline(tiny_llama, tmp_path):
    """What `make bench-pd ARGS=--quick` runs (the chat workload of real text), with the tiny model and
    pd-serve alone (the P/D clusters it starts are deploy/processes.py's, exercised above): the run, its
    plots, the comparison, the logs; every request is one of bench/chat.py's conversations."""
    proc = subprocess.run([sys.executable, "-m", "pdserve.bench.pd_matrix", "--quick", "--setups", "pd-serve", "--model",
                           str(tiny_llama), "--output-dir", str(tmp_path), "--no-progress", "--no-plots"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = schema.load(tmp_path / "pd-serve.json")
    assert res["workload"] == {"name": "chat", "params": {"num_requests": 4, "answer_len": 8}}
    assert res["summary"]["completed"] == 4
    lengths = [r["prompt_tokens"] for r in sorted(res["requests"], key=lambda r: r["session"])]
    assert lengths == sorted(lengths) and len(set(lengths)) == 4  # chat0..chat3: each history one exchange longer
    assert res["summary"]["goodput"]["slo"] == {"ttft_ms": 2000.0, "itl_ms": 200.0, "e2e_ms": None}
    assert res["metrics"]["urls"] == [res["endpoint"]["base_url"][:-3] + "/metrics"]
    assert res["summary"]["kv"]["prompt_tokens_computed"] > 0
    assert "| requests ok / sent | 4 / 4 |" in (tmp_path / "compare.md").read_text()
    assert png_size(tmp_path / "compare-overview.png") == plots.OVERVIEW_SIZE
    assert "ready at" in (tmp_path / "logs" / "pd-serve" / "pd-serve.out").read_text()


def test_compare_rejects_a_wrong_file(runs, tmp_path, capsys):
    bad = json.loads((runs / "rnd.json").read_text())
    bad["requests"][0]["ttft"] = "fast"
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    assert cli.main(["compare", str(runs / "rnd.json"), str(tmp_path / "bad.json"), "-o", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "bad.json: not a pd-bench/1 result: requests/0/ttft" in err


def test_bad_trace_line_names_file_and_line(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"prompt": "ok"}\n{"max_tokens": 3}\n')
    assert cli.main(["replay", str(trace), "--model", "m", "--base-url", "http://127.0.0.1:9"]) == 2
    assert f"{trace}:2: needs one of prompt" in capsys.readouterr().err


def _req(start, ttft, itl, ok=True, prompt=100, cached=50):
    return {"session": "s", "turn": 0, "start": start, "ok": ok, "status": 200 if ok else 500,
            "error": None if ok else "HTTP 500", "ttft": ttft if ok else None,
            "e2e": ttft + sum(itl) + 0.001 if ok else None, "itl": itl, "prompt_tokens": prompt if ok else None,
            "output_tokens": len(itl) + 1 if ok else 0, "cached_tokens": cached if ok else None}


def test_goodput_arithmetic_on_a_hand_made_trace():
    reqs = [_req(0.0, 0.2, [0.01, 0.03]),  # TTFT ok, mean ITL 20 ms ok, E2E 0.241 -> good
            _req(0.5, 0.6, [0.01]),  # TTFT 600 ms misses the 500 ms SLO
            _req(1.0, 0.1, [0.02, 0.1]),  # mean ITL 60 ms misses 50 ms (although its first gap is fine)
            _req(1.5, 0.4, []),  # one token: no gaps, meets any ITL SLO -> good
            _req(2.0, 0.0, [], ok=False),  # failed: never good
            _req(2.5, 0.3, [0.05, 0.05, 0.05])]  # mean exactly 50 ms: meets "<=" -> good
    s = stats.summarize(reqs, stats.SLO(ttft_s=stats.parse_duration("500ms"), itl_s=stats.parse_duration("50ms")))
    duration = (2.5 + 0.3 + 0.15 + 0.001) - 0.0
    assert s["duration_s"] == pytest.approx(duration, abs=1e-4)
    assert s["goodput"]["good_requests"] == 3 and s["goodput"]["fraction"] == 0.5
    assert s["goodput"]["req_per_s"] == pytest.approx(3 / duration, abs=1e-4)
    assert s["goodput"]["slo"] == {"ttft_ms": 500.0, "itl_ms": 50.0, "e2e_ms": None}
    assert s["completed"] == 5 and s["failed"] == 1
    assert s["request_throughput"] == pytest.approx(5 / duration, abs=1e-4)
    assert s["output_throughput"] == pytest.approx(13 / duration, abs=1e-4)
    assert s["output_tokens"] == 13 and s["cached_tokens"] == 250 and s["cached_fraction"] == 0.5
    assert s["ttft_ms"]["p50"] == pytest.approx(300.0) and s["ttft_ms"]["mean"] == pytest.approx(320.0)
    assert s["itl_ms"]["p50"] == pytest.approx(40.0)  # gaps 10 10 20 30 | 50 50 50 100 ms: median 40 ms
    # An E2E SLO alone: only the requests done within 250 ms (E2E 241 and 221 ms) count.
    s = stats.summarize(reqs, stats.SLO(e2e_s=0.25))
    assert s["goodput"]["good_requests"] == 2
    assert stats.summarize(reqs, stats.SLO())["goodput"] is None
    jsonschema.validate(s, schema.SCHEMA["properties"]["summary"])


@pytest.mark.parametrize("text,seconds", [("500ms", 0.5), ("0.5s", 0.5), ("2s", 2.0), ("250", 0.25),
                                          ("750us", 0.00075)])
def test_parse_duration(text, seconds):
    assert stats.parse_duration(text) == pytest.approx(seconds)


def test_bad_duration_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["random", "--slo-ttft", "soon"])
    assert e.value.code == 2 and "not a duration: 'soon'" in capsys.readouterr().err
