"""Drives a workload against an endpoint: when each request starts, and what is sampled meanwhile.

Three ways to pace requests:
- timed traces (replay with timestamps, no --qps/--concurrency): each request at its
  timestamp x time_scale, a session's next turn no earlier than its previous answer;
- `--qps Q`: arrivals at Q per second (Poisson or uniform gaps); each arrival takes the next
  session whose turn is ready (a conversation's next turn waits for the previous answer, so
  an arrival may wait too); optionally capped by `--concurrency`;
- `--concurrency C` alone: closed loop, C requests in flight at all times.
With neither, every ready turn is sent at once.
"""
from __future__ import annotations

import asyncio
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from tqdm import tqdm

from pdserve.bench import scrape
from pdserve.bench.client import RequestOptions, RequestRecord, send
from pdserve.bench.workloads import Session, Turn, Workload

TIMELINE_METRICS = (scrape.KV_HIT_TOKENS, scrape.KV_LOADED_TOKENS, scrape.KV_LOOKUPS, scrape.PREFIX_HITS,
                    scrape.PREFIX_QUERIES, scrape.PROMPT_COMPUTED)


@dataclass
class LoadConfig:
    qps: float | None = None
    concurrency: int | None = None
    arrival: str = "poisson"  # poisson | uniform
    time_scale: float = 1.0
    seed: int = 0
    request_timeout_s: float = 600.0
    metrics_interval_s: float = 1.0
    progress: bool = True
    warmup: int = 0


@dataclass
class RunResult:
    records: list[RequestRecord]
    metrics: dict[str, Any] | None = None
    started_unix: float = 0.0
    notes: list[str] = field(default_factory=list)


class _Pacer:
    """Arrival times for --qps: absolute schedule, so a slow loop does not lower the rate."""

    def __init__(self, load: LoadConfig, t0: float) -> None:
        self.load = load
        self.rng = random.Random(load.seed)
        self.next = t0

    async def wait(self) -> None:
        qps = self.load.qps
        if not qps or qps == float("inf"):
            return
        delay = self.next - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        self.next += self.rng.expovariate(qps) if self.load.arrival == "poisson" else 1.0 / qps


class Runner:
    def __init__(self, workload: Workload, base_url: str, opts: RequestOptions, load: LoadConfig,
                 scraper: scrape.Scraper | None = None) -> None:
        self.workload = workload
        self.base_url = base_url.rstrip("/")
        self.opts = opts
        self.load = load
        self.scraper = scraper
        self.records: list[RequestRecord] = []
        self._sem = asyncio.Semaphore(load.concurrency) if load.concurrency else None
        self._bar: tqdm | None = None
        self._t0 = 0.0

    async def _one(self, http: aiohttp.ClientSession, session: Session, turn: Turn) -> None:
        rec = await send(http, self.base_url, session, turn, self.opts, self._t0)
        session.record_answer(turn, rec.answer)
        session.next_turn += 1
        self.records.append(rec)
        if self._bar is not None:
            self._bar.update(1)
            if not rec.ok:
                self._bar.set_postfix(failed=sum(not r.ok for r in self.records))

    async def _limited(self, http: aiohttp.ClientSession, session: Session, turn: Turn) -> None:
        if self._sem is None:
            return await self._one(http, session, turn)
        async with self._sem:
            await self._one(http, session, turn)

    async def _timed_session(self, http: aiohttp.ClientSession, session: Session) -> None:
        for turn in session.turns:
            delay = self._t0 + (turn.arrival_s or 0.0) * self.load.time_scale - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            await self._limited(http, session, turn)

    async def _paced(self, http: aiohttp.ClientSession) -> None:
        ready: asyncio.Queue[Session] = asyncio.Queue()
        for s in self.workload.sessions:
            ready.put_nowait(s)
        pacer = _Pacer(self.load, self._t0)
        tasks = []

        async def turn_then_next(session: Session) -> None:
            try:
                await self._one(http, session, session.turns[session.next_turn])
            finally:
                if self._sem is not None:
                    self._sem.release()
            if session.next_turn < len(session.turns):
                ready.put_nowait(session)

        for _ in range(self.workload.num_requests):
            await pacer.wait()
            session = await ready.get()
            if self._sem is not None:
                await self._sem.acquire()
            tasks.append(asyncio.create_task(turn_then_next(session)))
        await asyncio.gather(*tasks)

    async def _warmup(self, http: aiohttp.ClientSession) -> None:
        for i in range(self.load.warmup):
            rec = await send(http, self.base_url, Session(f"warmup{i}", []), Turn(4, text=f"warm-up {i}: hello"),
                             self.opts, time.perf_counter())
            if not rec.ok:
                raise RuntimeError(f"warm-up request failed: {rec.error}")

    async def _sample(self, http: aiohttp.ClientSession, timeline: list[dict[str, float]]) -> None:
        while True:
            await asyncio.sleep(self.load.metrics_interval_s)
            snap = await self.scraper.snapshot(http)
            timeline.append({"t": round(time.perf_counter() - self._t0, 3),
                             **{k: snap[k] for k in TIMELINE_METRICS if k in snap}})

    async def run(self) -> RunResult:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=self.load.request_timeout_s)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector, headers=self.opts.headers) as http:
            await self._warmup(http)
            metrics = None
            if self.scraper is not None:
                await self.scraper.keep_answering(http)
            if self.scraper is not None and self.scraper.urls:
                metrics = {"urls": self.scraper.urls, "before": await self.scraper.snapshot(http), "timeline": []}
            self._bar = tqdm(total=self.workload.num_requests, unit="req", file=sys.stderr, dynamic_ncols=True,
                             disable=not self.load.progress, desc=self.workload.name)
            started = time.time()
            self._t0 = time.perf_counter()
            sampler = asyncio.create_task(self._sample(http, metrics["timeline"])) if metrics else None
            try:
                if self.workload.timed and not (self.load.qps or self.load.concurrency):
                    await asyncio.gather(*(self._timed_session(http, s) for s in self.workload.sessions))
                else:
                    await self._paced(http)
            finally:
                self._bar.close()
                if sampler is not None:
                    sampler.cancel()
                    await asyncio.gather(sampler, return_exceptions=True)
            if metrics is not None:
                metrics["after"] = await self.scraper.snapshot(http)
                metrics["delta"] = scrape.delta(metrics["before"], metrics["after"])
        self.records.sort(key=lambda r: r.start)
        return RunResult(self.records, metrics, started)
