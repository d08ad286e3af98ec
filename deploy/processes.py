"""Start, watch and stop a P/D cluster's processes on one host (used by `make serve` and the tests).

Every child is a real process (`python -m pdserve.prefill_node`, `decode_node`, `proxy`, plus
redis-server or LMCache's server when the store needs one) with its console output in a file
under the log directory. Nodes also write their own log via --log-file for `pd-kv-hits`.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.common import env
from pdserve.common.cpu_budget import EngineShare, read_budget, split_cores
from pdserve.deploy.listeners import owns_port
from pdserve.proxy.router import DEFAULT_POLICY

HOST = "127.0.0.1"
REPO = Path(__file__).resolve().parent.parent


def console_script(name: str) -> list[str]:
    """argv that runs the console script `name` as this checkout's pyproject.toml declares it.

    The venv's bin/ wrappers are written at install time and go stale when an entry point moves;
    this runs the declared `module:function` on the code under test, with argv[0] set to `name`.
    """
    with open(REPO / "pyproject.toml", "rb") as f:
        target = tomllib.load(f)["project"]["scripts"][name]
    module, func = target.split(":")
    code = f"import sys; sys.argv[0] = {name!r}; from {module} import {func}; sys.exit({func}())"
    return [sys.executable, "-c", code]


_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A port nothing listens on, for a child to bind a moment later.

    Picked below the kernel's ephemeral range: a port asked of the kernel with bind(0) comes from
    that range, where any outgoing connection can take it before the child binds it (CI saw a node
    fail to start that way). Below it only explicit binds compete, and none in this process twice;
    launchers running side by side (the test suite's workers) are given disjoint PDSERVE_PORT_RANGEs.
    """
    bottom, top = _port_range()
    rng = random.Random()
    for _ in range(2000):
        port = rng.randint(bottom, top)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((HOST, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port found on {HOST} between {bottom} and {top}")


def _port_range() -> tuple[int, int]:
    """PDSERVE_PORT_RANGE's `LOW-HIGH`, else 10000 up to the kernel's ephemeral range."""
    text = env.value(env.PORT_RANGE).strip()
    if text:
        try:
            bottom, top = (int(part) for part in text.split("-"))
        except ValueError:
            raise ValueError(f"{env.PORT_RANGE.name} must be LOW-HIGH (e.g. 20000-29999), got {text!r}") from None
        if not 1024 <= bottom <= top <= 65535:
            raise ValueError(f"{env.PORT_RANGE.name}={text}: need 1024 <= LOW <= HIGH <= 65535")
        return bottom, top
    return default_port_range()


def default_port_range() -> tuple[int, int]:
    """10000 up to the kernel's ephemeral range (an odd ephemeral range: 10000 and up)."""
    low, _ = _ephemeral_range()
    return 10000, (low - 1 if low > 11000 else 65535)


def wait_for_port(port: int, timeout_s: float, host: str = HOST) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=0.5).close()
            return True
        except OSError:
            time.sleep(0.05)
    return False


def require_port(port: int, timeout_s: float = 30.0, host: str = HOST) -> None:
    """wait_for_port, raising TimeoutError when nothing listens there by the deadline."""
    if not wait_for_port(port, timeout_s, host):
        raise TimeoutError(f"nothing listening on {host}:{port} after {timeout_s}s")


def wait_or_kill(proc: subprocess.Popen, timeout_s: float) -> int:
    """Wait for a signalled process, SIGKILL it after `timeout_s`; its exit status."""
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return proc.returncode


@dataclass
class Child:
    """One child process; output to `<log_dir>/<name>.out`."""

    name: str
    argv: list[str]
    log_dir: Path
    env: dict[str, str] | None = None
    ports: list[int] = field(default_factory=list)  # where it listens: checked before "ready"
    proc: subprocess.Popen | None = None
    _terminated: bool = False

    @property
    def out_path(self) -> Path:
        return self.log_dir / f"{self.name}.out"

    def start(self) -> None:
        self._terminated = False
        with open(self.out_path, "ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, **(self.env or {})})

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self) -> None:
        """SIGTERM once: a second one could hit the process after its handler is gone."""
        if self.alive and not self._terminated:
            self._terminated = True
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout_s`; the exit status (None if never started)."""
        if self.proc is None:
            return None
        self.terminate()
        return wait_or_kill(self.proc, timeout_s)

    def kill(self) -> None:
        """SIGKILL: a crash, for fault tests."""
        if self.alive:
            self.proc.kill()
            self.proc.wait()

    def listen_ports(self) -> list[int]:
        """The ports this child was given to listen on (a NodeProcess: HTTP and gRPC)."""
        return list(self.ports)

    def not_listening(self) -> list[int]:
        """Those of its ports this child does not hold a listening socket on (yet, or because another
        process has them); [] when the system cannot tell (deploy/listeners.py)."""
        if not self.alive:
            return self.listen_ports()
        return [p for p in self.listen_ports() if owns_port(self.proc.pid, p) is False]

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.out_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class NodeProcess(Child):
    """A prefill or decode node's process and its ports (the proxy's handle on a node is proxy/health.py's Node)."""

    role: str = "prefill"
    http_port: int = 0
    grpc_port: int = 0

    @property
    def log_file(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    def listen_ports(self) -> list[int]:
        return [self.http_port, self.grpc_port]

    @property
    def http_url(self) -> str:
        return f"http://{HOST}:{self.http_port}"

    @property
    def grpc_address(self) -> str:
        return f"{HOST}:{self.grpc_port}"


@dataclass
class ClusterSpec:
    model: str
    log_dir: Path
    kv_store: str | None = None  # file:///..., redis://..., lm://...; None with store="redis"/"lmcache" here
    store: str = "file"  # file | redis | lmcache: redis and lmcache get a server started here
    redis_maxmemory: str = "1gb"  # the redis started here evicts least recently used chunks beyond this
    num_prefill: int = 1
    num_decode: int = 1
    policy: str = DEFAULT_POLICY
    proxy_port: int = 0  # 0: a free port
    node_args: list[str] = field(default_factory=list)  # engine options for every node
    proxy_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


# Small, exact (fp32) nodes: the tests' clusters and the chaos harness (deploy/chaos.py). Chunk 64 = 4 blocks of
# 16, so prompts of a few hundred tokens span several chunks.
MAX_MODEL_LEN = 1024
CHUNK_SIZE = 64
NODE_ARGS = ["--dtype", "float32", "--kv-cache-memory", "32MiB", "--max-model-len", str(MAX_MODEL_LEN),
             "--chunk-size", str(CHUNK_SIZE), "--shutdown-timeout", "1"]


# The nodes of one LocalCluster run on this machine's CPUs together. Each sized as if alone (a thread per
# CPU each, spinning after every parallel region: libgomp's default, right for an engine that owns its
# cores) they burn the cores the other needs: two engines decoding at once ran 2-4x slower each than with
# a 100-iteration spin (docs/architecture.md, "One OpenMP team"). So the cluster sizes them together
# (common/cpu_budget.py split_cores): with 2 or more CPUs per engine each is pinned (taskset) to its own
# slice of the affinity mask with that many threads; otherwise they share the cores with a share of the
# threads each, and are told so (SHARED_CORES_ENV): their OpenMP workers then wait passively, unless the
# operator set OMP_WAIT_POLICY or GOMP_SPINCOUNT (the engine decides, serving/server.py run_node).
SHARED_CORES_ENV = {env.SHARED_CORES.name: "1"}


def shared_cores_env(environ: dict[str, str]) -> dict[str, str]:
    """`environ` for an engine that shares its cores with other engines."""
    return {**SHARED_CORES_ENV, **environ}


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


class LocalCluster:
    """Prefill nodes, decode nodes, a proxy and (for redis/lmcache) a store server on localhost."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        spec.log_dir.mkdir(parents=True, exist_ok=True)
        self.store_server: Child | None = None
        self.kv_store = spec.kv_store or self._store_server()
        self.cores, self.cores_line = self._split_cores(spec.num_prefill + spec.num_decode)
        self.prefill = [self._node("prefill", i, self.cores[i]) for i in range(spec.num_prefill)]
        self.decode = [self._node("decode", i, self.cores[spec.num_prefill + i]) for i in range(spec.num_decode)]
        self.proxy_port = spec.proxy_port or free_port()
        self.proxy = Child("proxy", python_module(
            "pdserve.proxy", "--host", HOST, "--port", str(self.proxy_port), "--policy", spec.policy,
            "--prefill", ",".join(n.grpc_address for n in self.prefill),
            "--decode", ",".join(n.grpc_address for n in self.decode), *spec.proxy_args), spec.log_dir, spec.env,
            ports=[self.proxy_port])

    def _store_server(self) -> str:
        port = free_port()
        if self.spec.store == "redis":
            exe = shutil.which("redis-server")
            if exe is None:
                raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
            argv = [exe, "--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no",
                    "--maxmemory", self.spec.redis_maxmemory, "--maxmemory-policy", "allkeys-lru"]
            self.store_server = Child("redis", argv, self.spec.log_dir, ports=[port])
            return f"redis://{HOST}:{port}/0"
        if self.spec.store == "lmcache":
            self.store_server = Child("lmcache", python_module("lmcache.v1.server", HOST, str(port), "cpu"),
                                      self.spec.log_dir, ports=[port])
            return f"lm://{HOST}:{port}"
        store_dir = self.spec.log_dir / "kvstore"
        return store_dir.resolve().as_uri()

    def _split_cores(self, engines: int) -> tuple[list[EngineShare | None], str]:
        """Each node's threads and CPUs (None: node_args give --threads, the cores are shared), and a line that
        says what was done. Without taskset nothing is pinned."""
        budget = read_budget()
        if "--threads" in self.spec.node_args:
            return [None] * engines, (f"cores: {engines} engines share {budget.reason} with the --threads of their "
                                      "options, OpenMP workers waiting passively")
        return split_cores(engines, budget, None if shutil.which("taskset") else [])

    def _node(self, role: str, index: int, share: EngineShare | None) -> NodeProcess:
        name = f"{role}{index}"
        pinned = share is not None and share.cpus is not None
        node = NodeProcess(name, [], self.spec.log_dir, self.spec.env if pinned else shared_cores_env(self.spec.env),
                           role=role, http_port=free_port(), grpc_port=free_port())
        node.argv = [*(["taskset", "-c", share.taskset] if pinned else []), *python_module(
            f"pdserve.{role}_node", "--model", self.spec.model, "--kv-store", self.kv_store, "--host", HOST,
            "--port", str(node.http_port), "--grpc-port", str(node.grpc_port), "--log-file", str(node.log_file),
            *(["--threads", str(share.threads)] if share is not None else []), *self.spec.node_args)]
        return node

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.proxy_port}"

    @property
    def children(self) -> list[Child]:
        store = [self.store_server] if self.store_server else []
        return [*store, *self.prefill, *self.decode, self.proxy]

    def start(self, timeout_s: float = 120.0) -> None:
        """Start everything and wait until the proxy sees every node healthy; RuntimeError otherwise."""
        try:
            if self.store_server is not None:
                self.store_server.start()
                port = int(self.kv_store.rsplit(":", 1)[1].split("/")[0])
                if not wait_for_port(port, 30.0):
                    raise RuntimeError(f"{self.store_server.name} did not start:\n{self.store_server.tail()}")
            for child in [*self.prefill, *self.decode, self.proxy]:
                child.start()
            self.wait_healthy(len(self.prefill), len(self.decode), timeout_s)
        except BaseException:
            self.stop()
            raise

    def status(self) -> dict | None:
        try:
            with urllib.request.urlopen(self.url + "/status", timeout=2) as r:
                return json.loads(r.read())
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def wait_healthy(self, num_prefill: int, num_decode: int, timeout_s: float = 60.0) -> dict:
        """Until the proxy reports this many healthy prefill and decode nodes, and every child still running
        listens on the ports it was given (an answer from another process on one of them does not count);
        raises if a child died or the deadline passed."""
        deadline = time.monotonic() + timeout_s
        status = None
        while time.monotonic() < deadline:
            failed = [c for c in self.children if c.proc is not None and (c.proc.poll() or 0) > 0]
            if failed:  # exited on its own with an error (a node we killed has a negative status)
                raise RuntimeError(f"{failed[0].name} exited with {failed[0].proc.returncode}:\n{failed[0].tail()}")
            status = self.status()
            if status and sum(n["healthy"] for n in status["prefill"]) == num_prefill \
                    and sum(n["healthy"] for n in status["decode"]) == num_decode \
                    and not self.not_listening() and self._nodes_answer():
                return status
            time.sleep(0.2)
        missing = self.not_listening()
        where = "; ".join(f"{name} does not listen on {', '.join(f'{HOST}:{p}' for p in ports)}"
                          for name, ports in missing.items())
        raise RuntimeError(f"cluster not healthy after {timeout_s:.0f}s: " + (where or f"proxy status {status}"))

    def not_listening(self) -> dict[str, list[int]]:
        """{child: its ports it holds no listening socket on}, over the children still running."""
        out = {}
        for child in self.children:
            if child.alive and (ports := child.not_listening()):
                out[child.name] = ports
        return out

    def _nodes_answer(self) -> bool:
        """Every running node's HTTP port answers /health (the proxy's check covers gRPC only)."""
        for node in [*self.prefill, *self.decode]:
            if not node.alive:
                continue
            try:
                with urllib.request.urlopen(node.http_url + "/health", timeout=2) as r:
                    if r.status != 200:
                        return False
            except (urllib.error.URLError, OSError):
                return False
        return True

    def stop(self) -> dict[str, int | None]:
        """Stop the proxy first (no new requests), then the nodes, then the store server."""
        codes = {}
        for child in [self.proxy, *self.prefill, *self.decode]:
            child.terminate()
        for child in [self.proxy, *self.prefill, *self.decode]:
            codes[child.name] = child.stop()
        if self.store_server is not None:
            codes[self.store_server.name] = self.store_server.stop()
        return codes
