"""Chaos on a real local P/D cluster: inject one fault while streams run (bench/chaos.py sends and counts them).

Shared by tests/cluster/test_chaos.py (a few requests per scenario, asserted) and benchmarks/chaos.py
(hundreds, tabulated). The cluster is pd-proxy + 1 prefill + 2 decode nodes + a real
redis-server reached through deploy.fault_relay (so the store can be made slow); every fault
is real: SIGSTOP/SIGKILL of a process, a delayed TCP path, a store object copied under another
key, malformed HTTP requests. A fault is `fault(progress)`, awaited beside the streams; progress["tokens"]
counts the tokens they have received so far.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from pdserve.deploy.fault_relay import FaultRelay
from pdserve.deploy.processes import CHUNK_SIZE, HOST, NODE_ARGS, ClusterSpec, LocalCluster, NodeProcess
from pdserve.deploy.redis_servers import RedisServer

LOAD_TIMEOUT_S = 4.0  # the nodes' --kv-load-timeout: a frozen store costs a request at most this
# Proxy deadlines: a frozen node is noticed by its silent stream within STALL_S. No scenario waits for the
# token deadline: a stream that ends only there has hung, so it lies beyond what a test would call hung
# (twice tests/helpers/timing.py's HANG_S).
STALL_S = 2.0
TOKEN_S = 120.0
# With no decode node left to resume on, a stream waits this long for one to come back (pd-proxy
# --decode-recovery-timeout): short here, so that the scenario that kills every decode node ends soon.
RECOVERY_S = 2 * STALL_S
PROXY_ARGS = ["--health-interval", "0.3", "--connect-timeout", "2", "--first-token-timeout", "60",
              "--token-timeout", str(TOKEN_S), "--stall-timeout", str(STALL_S),
              "--decode-recovery-timeout", str(RECOVERY_S)]
# One OpenMP thread per node: two spinning threads per step make a busy machine's steps 10x slower.
NODE_ENV = {"OMP_NUM_THREADS": "1"}


# ---------------------------------------------------------------- the cluster

class ChaosCluster:
    """The cluster plus handles on every process a fault may hit."""

    def __init__(self, model: Path, log_dir: Path, num_decode: int = 2, proxy_args: list[str] | None = None) -> None:
        """`proxy_args`: pd-proxy's flags after PROXY_ARGS (a later flag overrides an earlier one)."""
        self.redis = RedisServer()
        self.redis.start()
        self.relay = FaultRelay(HOST, self.redis.port)
        self.relay.start()
        spec = ClusterSpec(model=str(model), log_dir=log_dir, kv_store=f"redis://{HOST}:{self.relay.port}/0",
                           num_prefill=1, num_decode=num_decode,
                           node_args=[*NODE_ARGS, "--kv-load-timeout", str(LOAD_TIMEOUT_S)],
                           proxy_args=[*PROXY_ARGS, *(proxy_args or [])], env=NODE_ENV)
        self.cluster = LocalCluster(spec)
        try:
            self.cluster.start(timeout_s=240)
        except BaseException:
            self.relay.stop()
            self.redis.stop()
            raise

    @property
    def url(self) -> str:
        return self.cluster.url

    @property
    def decode(self) -> list[NodeProcess]:
        return self.cluster.decode

    def stop(self) -> None:
        for child in self.cluster.children:  # a frozen process would never stop
            if child.alive:
                os.kill(child.proc.pid, signal.SIGCONT)
        os.kill(self.redis.proc.pid, signal.SIGCONT)
        self.cluster.stop()
        self.relay.stop()
        self.redis.stop()

    def healthy(self) -> None:
        """Everything back to normal: thawed, restarted, fast store, every node in rotation."""
        os.kill(self.redis.proc.pid, signal.SIGCONT)
        self.relay.delay_s = 0.0
        for node in [*self.cluster.prefill, *self.cluster.decode]:
            if node.alive:
                os.kill(node.proc.pid, signal.SIGCONT)
            else:
                node.start()
        self.cluster.wait_healthy(len(self.cluster.prefill), len(self.cluster.decode), timeout_s=180)

    def misplace_chunk(self, src_prompt: list[int], src_salt: str, dst_prompt: list[int], dst_salt: str) -> int:
        """Copy the first stored chunk of one prompt (every layer and its commit marker) under the key of
        another prompt's first chunk: a valid object in the wrong place. Returns the objects copied."""
        import redis

        from pdserve.common.hashing import chunk_keys

        r = redis.Redis(host=HOST, port=self.redis.port)
        fingerprints = {k.split(b":")[1] for k in r.scan_iter(match=b"pdkv:*", count=1000)}
        assert len(fingerprints) == 1, fingerprints
        fp = fingerprints.pop().decode()
        src = chunk_keys(fp, src_prompt, CHUNK_SIZE, src_salt)[0]
        dst = chunk_keys(fp, dst_prompt, CHUNK_SIZE, dst_salt)[0]
        copied = 0
        for name in r.scan_iter(match=f"pdkv:{fp}:{{{src}}}:*".encode()):
            suffix = name.rsplit(b":", 1)[1].decode()
            r.set(f"pdkv:{fp}:{{{dst}}}:{suffix}", r.get(name))
            copied += 1
        r.close()
        return copied


async def wait_tokens(progress: Counter, n: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while progress["tokens"] < n and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


# ---------------------------------------------------------------- faults

@contextlib.contextmanager
def stopped(pid: int):
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def frozen_redis(chaos: ChaosCluster, hold_s: float, after_tokens: int) -> Callable[[Counter], Awaitable[None]]:
    """SIGSTOP redis once streams run (new requests then find the store frozen), SIGCONT after hold_s."""
    async def fault(progress: Counter) -> None:
        await wait_tokens(progress, after_tokens)
        with stopped(chaos.redis.proc.pid):
            await asyncio.sleep(hold_s)
    return fault


def slow_store(chaos: ChaosCluster, delay_s: float, hold_s: float) -> Callable[[Counter], Awaitable[None]]:
    """Every redis reply `delay_s` late (through the relay) for hold_s."""
    async def fault(progress: Counter) -> None:
        chaos.relay.delay_s = delay_s
        try:
            await asyncio.sleep(hold_s)
        finally:
            chaos.relay.delay_s = 0.0
    return fault


def killed_decode(chaos: ChaosCluster, after_tokens: int) -> Callable[[Counter], Awaitable[None]]:
    """SIGKILL decode node 0 once streams run."""
    async def fault(progress: Counter) -> None:
        await wait_tokens(progress, after_tokens)
        chaos.decode[0].kill()
    return fault


def frozen_decode(chaos: ChaosCluster, hold_s: float, after_tokens: int) -> Callable[[Counter], Awaitable[None]]:
    """SIGSTOP decode node 0 once streams run, SIGCONT after hold_s."""
    async def fault(progress: Counter) -> None:
        await wait_tokens(progress, after_tokens)
        with stopped(chaos.decode[0].proc.pid):
            await asyncio.sleep(hold_s)
    return fault


# ---------------------------------------------------------------- malformed requests

def malformed_requests() -> list[tuple[str, dict[str, str], bytes, int]]:
    """(what, extra headers, body, expected status): the issue's table of bad input, plus kin."""
    ok = {"prompt": [5, 6, 7], "max_tokens": 4}

    def body(**kw: Any) -> bytes:
        return json.dumps({**ok, **kw}).encode()

    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b', "max_tokens": 4}'
    return [
        ("max_tokens 1e12", {}, body(max_tokens=1e12), 400),
        ("max_tokens 2^63", {}, body(max_tokens=2**63), 400),
        ("seed 2^70", {}, body(seed=2**70, temperature=1.0), 400),
        ("seed 2^63", {}, body(seed=2**63, temperature=1.0), 400),
        ("top_k 2^40", {}, body(top_k=2**40), 400),
        ("token id 2^40", {}, json.dumps({"prompt": [5, 2**40], "max_tokens": 4}).encode(), 400),
        ("lone surrogate", {}, b'{"prompt": "abc \\ud800 def", "max_tokens": 4}', 400),
        ("NaN temperature", {}, b'{"prompt": [5, 6], "max_tokens": 4, "temperature": NaN}', 400),
        ("100k-deep JSON", {}, deep, 400),
        ("8KB X-Request-Id", {"X-Request-Id": "r" * 8200}, body(), 400),
        ("10MB prompt", {}, body(prompt="x" * 10_000_000), 413),
        ("not JSON", {}, b"{prompt: ", 400),
    ]


async def send_malformed(url: str) -> list[tuple[str, int, int, str, float]]:
    """(what, expected, got, error type, seconds) per malformed request, sent one after another."""
    results = []
    async with httpx.AsyncClient(timeout=60.0) as client:
        for what, headers, body, expected in malformed_requests():
            started = time.monotonic()
            try:
                resp = await client.post(url + "/v1/completions", content=body,
                                         headers={"Content-Type": "application/json", **headers})
                status, text = resp.status_code, resp.text
            except httpx.HTTPError as e:
                status, text = 0, str(e)
            try:
                kind = json.loads(text)["error"]["type"]
            except (ValueError, KeyError, TypeError):
                kind = "not OpenAI JSON: " + text[:80]
            results.append((what, expected, status, kind, time.monotonic() - started))
    return results
