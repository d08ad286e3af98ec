"""Chaos on a real local P/D cluster: inject one fault while streams run, count what survives.

Shared by tests/cluster/test_chaos.py (a few requests per scenario, asserted) and benchmarks/chaos.py
(hundreds, tabulated). The cluster is pd-proxy + 1 prefill + 2 decode nodes + a real
redis-server reached through deploy.fault_relay (so the store can be made slow); every fault
is real: SIGSTOP/SIGKILL of a process, a delayed TCP path, a store object copied under another
key, malformed HTTP requests. A request counts as `exact` when its tokens equal the same
request's tokens in a run without any fault.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pdserve.deploy.fault_relay import FaultRelay
from pdserve.deploy.processes import HOST, ClusterSpec, LocalCluster, NodeProcess
from tests.helpers.cluster import CHUNK_SIZE, NODE_ARGS
from tests.helpers.timing import HANG_S
from tests.helpers.utils import RedisServer

LOAD_TIMEOUT_S = 4.0  # the nodes' --kv-load-timeout: a frozen store costs a request at most this
# Proxy deadlines: a frozen node is noticed by its silent stream within STALL_S. No scenario waits for the
# token deadline: a stream that ends only there has hung, so it lies beyond what a test would call hung.
STALL_S = 2.0
TOKEN_S = 2 * HANG_S
PROXY_ARGS = ["--health-interval", "0.3", "--connect-timeout", "2", "--first-token-timeout", "60",
              "--token-timeout", str(TOKEN_S), "--stall-timeout", str(STALL_S)]
# One OpenMP thread per node: two spinning threads per step make a busy machine's steps 10x slower.
NODE_ENV = {"OMP_NUM_THREADS": "1"}


# ---------------------------------------------------------------- the cluster

class ChaosCluster:
    """The cluster plus handles on every process a fault may hit."""

    def __init__(self, model: Path, log_dir: Path, num_decode: int = 2) -> None:
        self.redis = RedisServer()
        self.redis.start()
        self.relay = FaultRelay(HOST, self.redis.port)
        self.relay.start()
        spec = ClusterSpec(model=str(model), log_dir=log_dir, kv_store=f"redis://{HOST}:{self.relay.port}/0",
                           num_prefill=1, num_decode=num_decode,
                           node_args=[*NODE_ARGS, "--kv-load-timeout", str(LOAD_TIMEOUT_S)],
                           proxy_args=PROXY_ARGS, env=NODE_ENV)
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


# ---------------------------------------------------------------- the client side

@dataclass
class Outcome:
    """What the client saw of one request."""

    index: int
    status: int = 0
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None  # an error body, or an in-band error event
    completion_tokens: int | None = None
    latency_s: float = 0.0
    max_gap_s: float = 0.0  # the longest wait between two chunks with tokens


def request_bodies(n: int, seed: int = 0, prompt_range: tuple[int, int] = (80, 300),
                   max_tokens_range: tuple[int, int] = (24, 64)) -> list[dict[str, Any]]:
    """Streamed completions over token-id prompts: greedy and seeded sampling alternate."""
    rng = random.Random(seed)
    bodies = []
    for i in range(n):
        prompt = [rng.randrange(3, 259) for _ in range(rng.randint(*prompt_range))]
        body = {"prompt": prompt, "max_tokens": rng.randint(*max_tokens_range), "stream": True,
                "ignore_eos": True, "return_token_ids": True, "stream_options": {"include_usage": True}}
        body.update({"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.8, "seed": 1000 + i})
        bodies.append(body)
    return bodies


async def send(client: httpx.AsyncClient, url: str, index: int, body: dict[str, Any], salt: str,
               progress: Counter | None = None) -> Outcome:
    """One streamed completion; `progress["tokens"]` counts tokens received across requests."""
    out = Outcome(index)
    started = last = time.monotonic()
    try:
        async with client.stream("POST", url + "/v1/completions", json={**body, "cache_salt": salt},
                                 headers={"X-Request-Id": f"{salt}-{index}"}) as resp:
            out.status = resp.status_code
            if resp.status_code != 200:
                out.error = (await resp.aread()).decode(errors="replace")[:300]
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out.error = json.dumps(event["error"])[:300]
                    continue
                if event.get("usage"):
                    out.completion_tokens = event["usage"]["completion_tokens"]
                for choice in event.get("choices", []):
                    ids = choice.get("token_ids") or []
                    if ids:
                        now = time.monotonic()
                        out.max_gap_s = max(out.max_gap_s, now - last) if out.token_ids else 0.0
                        last = now
                        out.token_ids.extend(ids)
                        if progress is not None:
                            progress["tokens"] += len(ids)
                    if choice.get("finish_reason"):
                        out.finish_reason = choice["finish_reason"]
    except httpx.HTTPError as e:
        out.error = f"{type(e).__name__}: {e}"
    finally:
        out.latency_s = time.monotonic() - started
    return out


async def run_load(url: str, bodies: list[dict[str, Any]], salt: str, concurrency: int,
                   fault: Callable[[Counter], Awaitable[Any]] | None = None) -> tuple[list[Outcome], Any]:
    """All bodies with at most `concurrency` in flight, `fault(progress)` running beside them."""
    progress: Counter = Counter()
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 16, max_keepalive_connections=concurrency + 16)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=10.0), limits=limits) as client:
        async def one(i: int, body: dict[str, Any]) -> Outcome:
            async with gate:
                return await send(client, url, i, body, salt, progress)

        fault_task = asyncio.ensure_future(fault(progress)) if fault else None
        outcomes = await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies)))
        fault_result = await fault_task if fault_task else None
    return list(outcomes), fault_result


async def wait_tokens(progress: Counter, n: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while progress["tokens"] < n and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


# ---------------------------------------------------------------- counting

@dataclass
class Tally:
    """One scenario's counts: what was sent, finished properly, matched the no-fault run, failed."""

    scenario: str
    sent: int = 0
    ok: int = 0  # 200, a finish_reason, no error event
    exact: int = 0  # ok, and the same tokens (and completion_tokens) as without the fault
    truncated: int = 0  # 200 but no finish_reason, or an in-band error
    failed: Counter = field(default_factory=Counter)  # HTTP status (0: no answer) -> count
    worst_latency_s: float = 0.0
    worst_gap_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, scenario: str, outcomes: list[Outcome], reference: dict[int, list[int]] | None) -> Tally:
        t = cls(scenario, sent=len(outcomes))
        for o in outcomes:
            t.worst_latency_s = max(t.worst_latency_s, o.latency_s)
            t.worst_gap_s = max(t.worst_gap_s, o.max_gap_s)
            if o.status != 200:
                t.failed[o.status] += 1
            elif o.finish_reason is None or o.error is not None:
                t.truncated += 1
            else:
                t.ok += 1
                if reference is None or (o.token_ids == reference[o.index]
                                         and o.completion_tokens == len(o.token_ids)):
                    t.exact += 1
        return t

    def row(self) -> str:
        failed = ",".join(f"{s}:{c}" for s, c in sorted(self.failed.items())) or "-"
        return (f"{self.scenario:<16} {self.sent:>5} {self.ok:>5} {self.exact:>6} {failed:>10} {self.truncated:>9} "
                f"{self.worst_latency_s:>10.2f} {self.worst_gap_s:>9.2f}")

    @staticmethod
    def header() -> str:
        return (f"{'scenario':<16} {'sent':>5} {'ok':>5} {'exact':>6} {'failed':>10} {'truncated':>9} "
                f"{'latency s':>10} {'gap s':>9}")


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
