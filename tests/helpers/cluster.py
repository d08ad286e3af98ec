"""Helpers for the P/D cluster tests: real node, proxy and store processes via deploy.processes."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai

from pdserve.deploy.processes import NODE_ARGS, Child, ClusterSpec, LocalCluster, python_module
from tests.helpers.timing import HANG_S


def start_cluster(model: Path, log_dir: Path, store: str = "file", num_prefill: int = 1, num_decode: int = 1,
                  policy: str = "least-loaded", proxy_args: list[str] | None = None,
                  node_args: list[str] | None = None) -> LocalCluster:
    """node_args: the nodes' engine options (default NODE_ARGS)."""
    cluster = LocalCluster(ClusterSpec(model=str(model), log_dir=log_dir, store=store, num_prefill=num_prefill,
                                       num_decode=num_decode, policy=policy,
                                       node_args=list(NODE_ARGS if node_args is None else node_args),
                                       proxy_args=["--health-interval", "0.3", *(proxy_args or [])]))
    cluster.start(timeout_s=180)
    return cluster


def extra_proxy(cluster: LocalCluster, name: str, *args: str) -> tuple[Child, str]:
    """Another proxy over the same nodes (e.g. a second routing policy); (child, url) once it is healthy."""
    from pdserve.deploy.processes import HOST, free_port

    port = free_port()
    child = Child(name, python_module(
        "pdserve.proxy", "--port", str(port), "--health-interval", "0.3",
        "--prefill", ",".join(n.grpc_address for n in cluster.prefill),
        "--decode", ",".join(n.grpc_address for n in cluster.decode), *args), cluster.spec.log_dir)
    child.start()
    url = f"http://{HOST}:{port}"
    wait_until(lambda: _healthy_counts(url) == (len(cluster.prefill), len(cluster.decode)), f"{name} healthy", 60)
    return child, url


def _healthy_counts(url: str) -> tuple[int, int] | None:
    try:
        status = httpx.get(url + "/status", timeout=2).json()
    except (httpx.HTTPError, ValueError):
        return None
    return sum(n["healthy"] for n in status["prefill"]), sum(n["healthy"] for n in status["decode"])


def wait_until(predicate, what: str, timeout_s: float = HANG_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def client(url: str, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=120)


def post(url: str, path: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """(status, decoded JSON body) of a raw POST; bytes bodies are sent as they are."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(url + path, content=content, headers={"Content-Type": "application/json", **(headers or {})},
                   timeout=120)
    return r.status_code, r.json()


def status(url: str) -> dict:
    return httpx.get(url + "/status", timeout=5).json()


def routed(url: str) -> dict[str, int]:
    """Requests the proxy has sent to each node so far, by gRPC address."""
    s = status(url)
    return {n["address"]: n["routed"] for n in s["prefill"] + s["decode"]}


def kv_hits(*logs: Path) -> dict:
    """`pd-kv-hits --json` over node logs, as a real subprocess."""
    proc = subprocess.run([sys.executable, "-m", "pdserve.connectors.kv_hits", "--json", *map(str, logs)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def log_lines(path: Path, request_id: str) -> list[str]:
    pattern = re.compile(rf"Reqid: {re.escape(request_id)},")
    return [line for line in path.read_text(errors="replace").splitlines() if pattern.search(line)]
