"""The fleet's parts without model processes: a node's announcer and the proxy's registry source over a real
redis-server, the membership rules (join, leave, refuse another model, reuse a node that comes back) over
sources that answer what the test says, DNS over a name that resolves here, and pd-proxy's flag checks."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import redis

from pdserve.proxy.fleet import Fleet
from pdserve.proxy.fleet_sources import DNS, REDIS, STATIC, DnsSource, RedisRegistrySource, Sighting, SourceError
from pdserve.proxy.router import Router
from pdserve.serving.announce import INDEX_KEY, Announcement, Announcer, fleet_key, without_credentials
from pdserve.serving.auth import GrpcSecurity
from tests.helpers.timing import HANG_S


def _announcement(address: str = "127.0.0.1:7001", role: str = "decode", fingerprint: str = "a" * 32,
                  started_at: float = 1.0) -> Announcement:
    return Announcement(address=address, http_address="127.0.0.1:8001", role=role, model="tiny",
                        fingerprint=fingerprint, tensor_parallel_size=1, pipeline_parallel_size=1,
                        kv_store="redis://store:6379/0", started_at=started_at)


async def _until(predicate, what: str) -> None:
    deadline = time.monotonic() + HANG_S
    while not await predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def test_announcement_round_trip_and_credentials():
    a = _announcement()
    assert Announcement.from_json(a.to_json()) == a
    assert a.key == fleet_key("decode", "127.0.0.1:7001") == "pdserve:fleet:decode:127.0.0.1:7001"
    with pytest.raises(ValueError):
        Announcement.from_json('{"address": "x"}')
    assert without_credentials("redis://:secret@host:6379/0") == "redis://host:6379/0"
    assert without_credentials("redis://host:6379/0") == "redis://host:6379/0"


def test_announcer_and_registry_source(redis_module):
    """A node's key appears while it accepts, reads as draining the moment it stops (every proxy can tell why),
    and one that stops refreshing (a killed node) expires and leaves the index."""

    async def run() -> None:
        accepting = True
        announcer = Announcer(redis_module.url, _announcement(), lambda: accepting, ttl_s=3.0, refresh_s=0.2)
        source = RedisRegistrySource(redis_module.url)
        announcer.start()
        try:
            async def seen() -> bool:
                return [s.address for s in await source.poll()] == ["127.0.0.1:7001"]
            await _until(seen, "the announcement")
            (s,) = await source.poll()
            assert s.source == REDIS and s.role == "decode" and s.announcement.fingerprint == "a" * 32
            accepting = False  # the drain begins

            async def gone() -> bool:
                return await source.poll() == []
            await _until(gone, "the withdrawal")
            assert "draining" in source.why_gone(("decode", "127.0.0.1:7001"))
        finally:
            await announcer.stop()
            await source.close()

        dead = Announcer(redis_module.url, _announcement("127.0.0.1:7002"), lambda: True, ttl_s=0.5, refresh_s=0.2)
        source = RedisRegistrySource(redis_module.url)
        dead.start()
        try:
            async def seen2() -> bool:
                return any(s.address == "127.0.0.1:7002" for s in await source.poll())
            await _until(seen2, "the second announcement")
            dead._task.cancel()  # the process is gone: no withdrawal, no refresh

            async def expired() -> bool:
                return not any(s.address == "127.0.0.1:7002" for s in await source.poll())
            await _until(expired, "the key's expiry")
            assert "expired" in source.why_gone(("decode", "127.0.0.1:7002"))
            members = redis.Redis.from_url(redis_module.url).smembers(INDEX_KEY)
            assert fleet_key("decode", "127.0.0.1:7002").encode() not in members  # the index was cleaned
        finally:
            dead.announced = False
            await dead.stop()
            await source.close()

    asyncio.run(run())


def test_a_registry_that_does_not_answer_is_a_source_error():
    async def run() -> None:
        from pdserve.deploy.processes import free_port

        source = RedisRegistrySource(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.5)
        try:
            with pytest.raises(SourceError):
                await source.poll()
        finally:
            await source.close()

    asyncio.run(run())


class _Said:
    """A source whose answer the test sets."""

    def __init__(self, kind: str, sightings: list[Sighting] | None = None) -> None:
        self.kind, self.where, self.interval_s = kind, "test", None
        self.sightings = sightings or []
        self.fail = False

    async def poll(self) -> list[Sighting]:
        if self.fail:
            raise SourceError("down")
        return list(self.sightings)

    async def close(self) -> None:
        pass


def _fleet(*sources: _Said) -> tuple[Fleet, list[str]]:
    checked: list[str] = []

    async def check(node) -> None:
        checked.append(node.address)

    routers = {"prefill": Router([]), "decode": Router([])}
    return Fleet(routers, list(sources), GrpcSecurity(), check), checked


def _addresses(fleet: Fleet, role: str) -> list[str]:
    return [n.address for n in fleet.routers[role].nodes]


def test_membership_follows_the_sources(caplog):
    caplog.set_level("INFO")

    async def run() -> None:
        static = _Said(STATIC, [Sighting("10.0.0.1:1", "prefill", STATIC)])
        registry = _Said(REDIS, [Sighting("10.0.0.2:1", "decode", REDIS, _announcement("10.0.0.2:1"))])
        fleet, checked = _fleet(static, registry)
        await fleet.start()
        await asyncio.sleep(0)  # the join's health probe
        assert _addresses(fleet, "prefill") == ["10.0.0.1:1"] and _addresses(fleet, "decode") == ["10.0.0.2:1"]
        assert sorted(checked) == ["10.0.0.1:1", "10.0.0.2:1"]
        assert fleet.fingerprint == "a" * 32
        assert "10.0.0.2:1 joined the fleet: decode node found by redis" in caplog.text

        # another model is refused (one line), the same model joins
        other = Sighting("10.0.0.3:1", "decode", REDIS, _announcement("10.0.0.3:1", fingerprint="b" * 32))
        registry.sightings += [other,
                               Sighting("10.0.0.4:1", "decode", REDIS, _announcement("10.0.0.4:1"))]
        await fleet._poll(1)
        await fleet._poll(1)
        assert _addresses(fleet, "decode") == ["10.0.0.2:1", "10.0.0.4:1"]
        assert caplog.text.count("10.0.0.3:1 refused") == 1
        status = fleet.status()
        assert [r["address"] for r in status["refused"]] == ["10.0.0.3:1"]
        assert {n["address"]: n["source"] for n in status["nodes"]} == {
            "10.0.0.1:1": STATIC, "10.0.0.2:1": REDIS, "10.0.0.4:1": REDIS}

        # a source that fails keeps its last answer; one that drops a node takes it out of the router
        registry.fail = True
        await fleet._poll(1)
        assert len(fleet.routers["decode"].nodes) == 2
        registry.fail = False
        node = fleet.members[("decode", "10.0.0.2:1")]
        node.load.in_flight = 1  # a call still runs on it: its channel stays open until it ends
        registry.sightings = [s for s in registry.sightings if s.address != "10.0.0.2:1"]
        await fleet._poll(1)
        assert _addresses(fleet, "decode") == ["10.0.0.4:1"]
        assert "10.0.0.2:1 left the fleet: decode node found by redis" in caplog.text
        assert fleet.leaving[("decode", "10.0.0.2:1")] is node
        registry.sightings.append(Sighting("10.0.0.2:1", "decode", REDIS, _announcement("10.0.0.2:1")))
        await fleet._poll(1)  # back before its call ended: the same node (channel, counts) rejoins
        assert fleet.members[("decode", "10.0.0.2:1")] is node and not fleet.leaving

        # every announced node gone: the next model to come is the fleet's
        registry.sightings = [other]
        await fleet._poll(1)
        assert _addresses(fleet, "decode") == ["10.0.0.3:1"] and fleet.fingerprint == "b" * 32
        node.load.in_flight = 0
        await fleet.stop()

    asyncio.run(run())


def test_a_node_restarted_with_another_model_leaves():
    async def run() -> None:
        registry = _Said(REDIS, [Sighting("10.0.0.2:1", "decode", REDIS, _announcement("10.0.0.2:1")),
                                 Sighting("10.0.0.5:1", "decode", REDIS, _announcement("10.0.0.5:1"))])
        fleet, _ = _fleet(registry)
        await fleet.start()
        restarted = _announcement("10.0.0.5:1", fingerprint="c" * 32)
        registry.sightings[1] = replace(registry.sightings[1], announcement=restarted)
        await fleet._poll(0)
        assert _addresses(fleet, "decode") == ["10.0.0.2:1"]
        assert [r["address"] for r in fleet.status()["refused"]] == ["10.0.0.5:1"]
        await fleet.stop()

    asyncio.run(run())


def test_dns_source_resolves_a_records():
    async def run() -> None:
        assert await DnsSource("decode", "localhost:7003").poll() == [Sighting("127.0.0.1:7003", "decode", DNS)]
        try:  # a name with no records: no nodes (or, where no resolver answers at all, an error: last answer kept)
            assert await DnsSource("decode", "no-such-node.invalid:7003").poll() == []
        except SourceError:
            pass

    asyncio.run(run())


@pytest.mark.parametrize("argv, message", [
    ([], "no decode nodes"),
    (["--decode-dns", "pd-decode"], "expected NAME:PORT"),
])
def test_proxy_flags(argv, message):
    out = subprocess.run([sys.executable, "-m", "pdserve.proxy", *argv], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and message in out.stderr, out.stderr
