"""One planner among several proxies over one registry: the lease in a real redis-server (proxy/planner_lease.py)."""
from __future__ import annotations

import asyncio
import time

from pdserve.deploy.processes import free_port
from pdserve.proxy import planner_lease
from pdserve.proxy.planner import PlannerConfig
from pdserve.proxy.planner_lease import LEASE_KEY, PlannerLease
from pdserve.proxy.planner_loop import PlannerLoop


async def _until(check, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def test_one_proxy_holds_the_lease_and_another_takes_it_when_it_goes(redis_module, monkeypatch):
    monkeypatch.setattr(planner_lease, "_MIN_TTL_S", 0.3)

    async def run() -> None:
        a, b, c = (PlannerLease(redis_module.url, 0.05, ident=name) for name in ("a", "b", "c"))
        try:
            assert await a.held() and not await b.held() and await a.held()  # renewing keeps it
            assert (b.holder, b.status()["leader"], a.status()["holder"]) == ("a", False, "a")
            await a.release()  # a stopping proxy hands it back at once
            assert await b.held() and not await c.held() and c.holder == "b"
            # b stops renewing (killed): c takes over within one TTL, not before it ran out
            assert 0 < await b.client.pttl(LEASE_KEY) <= 300
            await _until(c.held, "c to take the lease after b's TTL")
            assert not await b.held() and b.holder == "c"
        finally:
            for lease in (b, c):
                await lease.release()

    asyncio.run(run())


def test_an_unreachable_registry_makes_a_follower_not_an_error():
    async def run() -> None:
        lease = PlannerLease(f"redis://127.0.0.1:{free_port()}/0", 5.0, timeout_s=0.3)
        try:
            assert not await lease.held()
            assert lease.status()["leader"] is False and lease.status()["error"]
        finally:
            await lease.release()

    asyncio.run(run())


def test_only_the_lease_holder_s_planner_decides(redis_module):
    """Two proxies' planner loops over one registry: one makes decisions (its GET /planner says it leads), the other
    holds and names it."""
    config = PlannerConfig(slo_itl_ms=50.0, interval_s=0.05)

    async def run() -> None:
        loops = [PlannerLoop(config, fleet=None, nodes=lambda: [],  # type: ignore[arg-type]
                             lease=PlannerLease(redis_module.url, config.interval_s, ident=name))
                 for name in ("first", "second")]
        loops[0].start()
        await _until(lambda: _true(loops[0].planner.decisions), "the first proxy's decisions")
        loops[1].start()
        await asyncio.sleep(0.5)  # ten intervals
        try:
            assert loops[0].planner.decisions and not loops[1].planner.decisions
            first, second = (loop.status()["lease"] for loop in loops)
            assert first["leader"] and not second["leader"] and second["holder"] == "first"
        finally:
            for loop in loops:
                await loop.stop()

    asyncio.run(run())


async def _true(value) -> bool:
    return bool(value)
