"""The client side of chaos on a real local P/D cluster (deploy/chaos.py): streams sent beside a fault, counted.

A request counts as `exact` when its tokens equal the same request's tokens in a run without any fault.
Each stream is read by pd-bench's client (pdserve.bench.client.stream); a request's worst gap is its longest
wait between two chunks with tokens.
"""
from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pdserve.bench.client import stream


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


def client_session(concurrency: int) -> aiohttp.ClientSession:
    """A session for `concurrency` streams and a few more requests: 300 s per read, 10 s to connect."""
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=300.0, sock_connect=10.0),
                                 connector=aiohttp.TCPConnector(limit=concurrency + 16))


async def send(client: aiohttp.ClientSession, url: str, index: int, body: dict[str, Any], salt: str,
               progress: Counter | None = None) -> Outcome:
    """One streamed completion; `progress["tokens"]` counts tokens received across requests."""
    def count(n: int) -> None:
        if progress is not None:
            progress["tokens"] += n

    started = time.monotonic()
    rec = await stream(client, url + "/v1/completions", {**body, "cache_salt": salt},
                       headers={"X-Request-Id": f"{salt}-{index}"}, on_tokens=count)
    return Outcome(index, rec.status, rec.token_ids, rec.finish_reason, rec.error, rec.completion_tokens,
                   time.monotonic() - started, max(rec.chunk_gaps, default=0.0))


async def run_load(url: str, bodies: list[dict[str, Any]], salt: str, concurrency: int,
                   fault: Callable[[Counter], Awaitable[Any]] | None = None) -> tuple[list[Outcome], Any]:
    """All bodies with at most `concurrency` in flight, `fault(progress)` running beside them."""
    progress: Counter = Counter()
    gate = asyncio.Semaphore(concurrency)
    async with client_session(concurrency) as client:
        async def one(i: int, body: dict[str, Any]) -> Outcome:
            async with gate:
                return await send(client, url, i, body, salt, progress)

        fault_task = asyncio.ensure_future(fault(progress)) if fault else None
        outcomes = await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies)))
        fault_result = await fault_task if fault_task else None
    return list(outcomes), fault_result


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


