"""Where the proxy learns which nodes exist: static lists, a Redis fleet registry, DNS.

Each source answers `poll()` with the nodes it sees now (`Sighting`s); proxy/fleet.py polls each on its
own interval and keeps the routers' node lists equal to the union. A source that cannot answer raises
`SourceError`, and the fleet keeps that source's last answer: a registry or DNS outage must not empty a
fleet whose nodes still serve (health checks still take dead ones out of rotation).
"""
from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass
from typing import Any, Protocol

from pdserve.serving.announce import INDEX_KEY, TTL_S, Announcement, host_port, without_credentials

logger = logging.getLogger(__name__)

STATIC, REDIS, DNS = "static", "redis", "dns"  # how a node was found (/fleet's `source`)
# A node announced joins within this (plus one health probe); a dead one leaves within TTL_S + this.
REGISTRY_POLL_S = 0.5
DNS_POLL_S = 2.0  # a headless Service's records change with pod readiness: seconds are soon enough

# Every live announcement, and the index cleaned of expired keys, in one atomic step (no node can refresh in
# between, so a live node's key is never dropped from the index).
_LIST_FLEET = """
local out = {}
for _, key in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local value = redis.call('GET', key)
  if value then out[#out + 1] = value else redis.call('SREM', KEYS[1], key) end
end
return out
"""


class SourceError(Exception):
    """The source could not say this time; its last answer stands."""


@dataclass(frozen=True)
class Sighting:
    """One node as one source sees it."""

    address: str  # gRPC host:port
    role: str  # prefill | decode
    source: str  # STATIC | REDIS | DNS
    announcement: Announcement | None = None  # what the node said of itself (registry only)

    @property
    def key(self) -> tuple[str, str]:
        return self.role, self.address


class Source(Protocol):
    kind: str
    where: str  # what it reads, for the log and /fleet (no credentials)
    interval_s: float | None  # None: its answer never changes

    async def poll(self) -> list[Sighting]: ...

    async def close(self) -> None: ...


class StaticSource:
    """Today's `--prefill` / `--decode` lists: always there (a dead one stays, out of rotation)."""

    kind, interval_s = STATIC, None

    def __init__(self, prefill: list[str], decode: list[str]) -> None:
        self.sightings = [Sighting(a, "prefill", STATIC) for a in prefill] + \
            [Sighting(a, "decode", STATIC) for a in decode]
        self.where = ", ".join(f"{s.role} {s.address}" for s in self.sightings)

    async def poll(self) -> list[Sighting]:
        return list(self.sightings)

    async def close(self) -> None:
        pass


class RedisRegistrySource:
    """The nodes announced in a Redis fleet registry (serving/announce.py writes it); draining ones left out."""

    kind, interval_s = REDIS, REGISTRY_POLL_S

    def __init__(self, url: str, timeout_s: float = 1.0) -> None:
        import redis.asyncio

        self.url = url
        self.where = without_credentials(url)
        self.client: Any = redis.asyncio.Redis.from_url(url, socket_timeout=timeout_s,
                                                        socket_connect_timeout=timeout_s)
        self._list = self.client.register_script(_LIST_FLEET)
        self.draining: set[tuple[str, str]] = set()  # what the last poll saw draining: why those left

    async def poll(self) -> list[Sighting]:
        import redis

        try:
            values = await self._list(keys=[INDEX_KEY])
        except (redis.RedisError, OSError) as e:
            raise SourceError(str(e) or type(e).__name__) from None
        out, draining = [], set()
        for value in values:
            try:
                a = Announcement.from_json(value)
            except ValueError as e:  # another program's key under our prefix: not ours to judge, not a node
                logger.debug("fleet registry %s: %s", self.where, e)
                continue
            if a.draining:
                draining.add((a.role, a.address))
            else:
                out.append(Sighting(a.address, a.role, REDIS, a))
        self.draining = draining
        return out

    def why_gone(self, key: tuple[str, str]) -> str:
        if key in self.draining:
            return "it is draining (SIGTERM)"
        return f"its announcement expired (silent for over {TTL_S:g} s)"

    async def close(self) -> None:
        await self.client.aclose()


class DnsSource:
    """The A records of a name (a Kubernetes headless Service's ready pods), each at `port`."""

    kind, interval_s = DNS, DNS_POLL_S

    def __init__(self, role: str, name_port: str) -> None:
        self.role = role
        self.name, _, port = name_port.rpartition(":")
        self.port = int(port)
        self.where = f"{role} {name_port}"

    async def poll(self) -> list[Sighting]:
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(self.name, self.port, family=socket.AF_INET,
                                                                  type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            if e.errno == socket.EAI_NONAME:  # the name has no records now (a Service with no ready pod)
                return []
            raise SourceError(f"cannot resolve {self.name}: {e.strerror or e}") from None
        hosts = sorted({info[4][0] for info in infos})
        return [Sighting(host_port(h, self.port), self.role, DNS) for h in hosts]

    async def close(self) -> None:
        pass


def fleet_sources(prefill: list[str], decode: list[str], registry: str | None, prefill_dns: str | None,
                  decode_dns: str | None) -> list[Source]:
    """The sources pd-proxy's flags name, static first (a node two sources list is shown as found by the first)."""
    sources: list[Source] = []
    if prefill or decode:
        sources.append(StaticSource(prefill, decode))
    if registry:
        sources.append(RedisRegistrySource(registry))
    for role, name in (("prefill", prefill_dns), ("decode", decode_dns)):
        if name:
            sources.append(DnsSource(role, name))
    return sources
