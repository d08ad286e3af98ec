"""The proxy's fleet: the nodes its sources see now, kept in the routers' node lists while it runs.

Each source (proxy/fleet_sources.py: static lists, a Redis registry, DNS) is polled on its own
interval; the fleet is the union of their last answers. A node that appears is connected, added to
its role's router (out of rotation until its first health probe, started at once, answers) and logged;
one that disappears is taken out of the router (no new request goes there) and logged, while calls
already on it go on (a draining node finishes them; a dead node's fail over as on any failure); its
channel closes once none is left. A node announcing a model fingerprint other than the fleet's is
refused with one log line: nodes of two models must never share requests or KV. `GET /fleet` lists
the fleet. One line per event, the node's address first.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from aiohttp import web

from pdserve.proxy.fleet_sources import RedisRegistrySource, Sighting, Source, SourceError
from pdserve.proxy.health import Node
from pdserve.proxy.kv_events_consumer import KVEventsConsumer
from pdserve.proxy.router import Router
from pdserve.serving.auth import GrpcSecurity

logger = logging.getLogger(__name__)

_RETIRE_POLL_S = 1.0  # how often a node that left is checked for calls still running on it

Key = tuple[str, str]  # (role, gRPC address)


class Fleet:
    def __init__(self, routers: dict[str, Router], sources: list[Source], security: GrpcSecurity,
                 check: Callable[[Node], Awaitable[None]]) -> None:
        self.routers = routers  # role -> its router, whose `nodes` list this class keeps
        self.sources = sources
        self.security = security
        self.check = check  # one health probe (HealthMonitor.check): a new node's first, so it joins at once
        self.members: dict[Key, Node] = {}
        self.leaving: dict[Key, Node] = {}  # left, calls still running on them
        self.refused: dict[Key, Sighting] = {}
        self.fingerprint: str | None = None  # the announced model fingerprint of the fleet's members
        self._seen: list[list[Sighting]] = [[] for _ in sources]  # each source's last answer
        self._errors: list[str | None] = [None] * len(sources)
        self._tasks: set[asyncio.Task] = set()
        self.kv_events: KVEventsConsumer | None = None  # its index forgets a node that leaves

    # ------------------------------------------------------------ polling
    async def start(self) -> None:
        """Poll every source once (static nodes are in the routers before the first health check), then keep
        polling each on its interval."""
        await asyncio.gather(*(self._poll(i) for i in range(len(self.sources))))
        for i, source in enumerate(self.sources):
            if source.interval_s is not None:
                self._spawn(self._keep_polling(i, source.interval_s))

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)  # a reference until it ends (the loop keeps only weak ones)
        task.add_done_callback(self._tasks.discard)

    async def poll_now(self) -> None:
        """Poll every source that changes once, now: a node the planner just moved (SetRole re-announced it) is
        in its new role's list when this returns, not up to an interval later."""
        await asyncio.gather(*(self._poll(i) for i, s in enumerate(self.sources) if s.interval_s is not None))

    async def _keep_polling(self, i: int, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self._poll(i)

    async def _poll(self, i: int) -> None:
        source = self.sources[i]
        try:
            self._seen[i] = await source.poll()
        except SourceError as e:
            if self._errors[i] is None:
                logger.warning("fleet source %s %s failed (%s): keeping its last %d nodes", source.kind, source.where,
                               e, len(self._seen[i]))
            self._errors[i] = str(e)
            return
        if self._errors[i] is not None:
            logger.info("fleet source %s %s answers again: %d nodes", source.kind, source.where, len(self._seen[i]))
            self._errors[i] = None
        self._update()

    # ------------------------------------------------------------ membership
    def _update(self) -> None:
        """Make the members the union of every source's last answer (the first source to list a node names it)."""
        wanted: dict[Key, Sighting] = {}
        for sightings in self._seen:
            for s in sightings:
                wanted.setdefault(s.key, s)
        for key in [k for k in self.members if k not in wanted or _restarted(self.members[k], wanted[k])]:
            # Announced under its other role now (a --role auto node the planner moved): same engine, same cache.
            moved = next((r for r, a in wanted if a == key[1] and r != key[0]), None)
            self._leave(key, moved)
        for key in [k for k in self.refused if k not in wanted]:
            del self.refused[key]
        if not any(n.announcement for n in self.members.values()):
            self.fingerprint = None  # no announced member left: the next model to come is the fleet's
        # Earliest-started first: proxies that see the same registry pick the same model when the fleet is empty.
        for s in sorted((s for k, s in wanted.items() if k not in self.members),
                        key=lambda s: s.announcement.started_at if s.announcement else 0.0):
            self._join(s)

    def _join(self, s: Sighting) -> None:
        a = s.announcement
        if a is not None and self.fingerprint is not None and a.fingerprint != self.fingerprint:
            if s.key not in self.refused or self.refused[s.key].announcement.fingerprint != a.fingerprint:
                logger.warning("%s refused: a %s node of model %s, fingerprint %s, and the fleet's fingerprint is %s "
                               "(nodes of two models never share requests or KV)", s.address, s.role, a.model,
                               a.fingerprint[:12], self.fingerprint[:12])
            self.refused[s.key] = s
            return
        self.refused.pop(s.key, None)
        if a is not None:
            self.fingerprint = a.fingerprint
        node = self.leaving.pop(s.key, None)  # back before its old calls were done: the same channel serves
        if node is None:
            node = Node(s.address, s.role, self.security)
            node.connect()
        node.source, node.since, node.announcement = s.source, time.time(), a
        self.members[s.key] = node
        self.routers[s.role].nodes.append(node)
        detail = f", model {a.model}, fingerprint {a.fingerprint[:12]}, tp {a.tensor_parallel_size} × pp " \
                 f"{a.pipeline_parallel_size}, store {a.kv_store or '-'}" if a else ""
        logger.info("%s joined the fleet: %s node found by %s %s%s", s.address, s.role, s.source,
                    self._where(s.source), detail)
        self._spawn(self.check(node))  # in rotation as soon as it answers, not at the next periodic check

    def _leave(self, key: Key, moved_to: str | None = None) -> None:
        node = self.members.pop(key)
        self.routers[node.role].nodes.remove(node)
        why = f"it switched roles to {moved_to}" if moved_to else self._why_gone(node.source, key)
        logger.info("%s left the fleet: %s node found by %s, %s; %d calls on it go on", node.address, node.role,
                    node.source, why, node.load.in_flight)
        self.leaving[key] = node
        self._spawn(self._retire(key, node))
        if self.kv_events is not None and moved_to is None:  # a moved node's prefix cache is still there
            self.kv_events.index.drop_node(node.address)

    async def _retire(self, key: Key, node: Node) -> None:
        """Close a departed node's channel once no call of ours runs on it (each call ends by its own deadlines)."""
        while node.load.in_flight > 0 and self.leaving.get(key) is node:
            await asyncio.sleep(_RETIRE_POLL_S)
        if self.leaving.get(key) is node:
            del self.leaving[key]
            await node.close()

    def _where(self, kind: str) -> str:
        return next((s.where for s in self.sources if s.kind == kind), "")

    def _why_gone(self, kind: str, key: Key) -> str:
        source = next((s for s in self.sources if s.kind == kind), None)
        if isinstance(source, RedisRegistrySource):
            return source.why_gone(key)
        return "its name no longer resolves to it" if kind != "static" else "removed"

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for node in [*self.members.values(), *self.leaving.values()]:
            await node.close()
        for source in self.sources:
            await source.close()
        if self.kv_events is not None:
            await self.kv_events.stop()

    # ------------------------------------------------------------ GET /fleet
    def status(self) -> dict[str, object]:
        return {"fingerprint": self.fingerprint,
                "sources": [{"kind": s.kind, "where": s.where, "interval_s": s.interval_s, "error": err}
                            for s, err in zip(self.sources, self._errors)],
                "nodes": [_node_entry(n) for n in self.members.values()],
                "refused": [{"address": s.address, "role": s.role, "source": s.source, "model": s.announcement.model,
                             "fingerprint": s.announcement.fingerprint} for s in self.refused.values()],
                "routing": {role: {"policy": r.policy, "lookup_rpcs": r.lookup_rpcs, "tokenize_rpcs": r.tokenize_rpcs}
                            for role, r in self.routers.items()},
                "kv_events": self.kv_events.status() if self.kv_events is not None else None}

    async def handle(self, request: web.Request) -> web.Response:
        return web.json_response(self.status())

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/fleet", self.handle)


def _restarted(node: Node, s: Sighting) -> bool:
    """The address announces another model now (restarted within the TTL): it leaves, and joins anew if it may."""
    return node.announcement is not None and s.announcement is not None and \
        node.announcement.fingerprint != s.announcement.fingerprint


def _node_entry(node: Node) -> dict[str, object]:
    """A member as /fleet shows it: how it was found and since when, health and load, what it announced."""
    a = node.announcement
    return {"address": node.address, "role": node.role, "source": node.source, "since": round(node.since, 3),
            "healthy": node.healthy, "last_error": node.last_error, "in_flight": node.load.in_flight,
            "running": node.load.num_running, "waiting": node.load.num_waiting, "routed": node.routed,
            "model": node.model_names[0] if node.model_names else (a.model if a else None),
            "fingerprint": a.fingerprint if a else None, "http_address": a.http_address if a else None,
            "tensor_parallel_size": a.tensor_parallel_size if a else None,
            "pipeline_parallel_size": a.pipeline_parallel_size if a else None,
            "kv_store": a.kv_store if a else None, "started_at": a.started_at if a else None,
            "switchable": bool(a and a.switchable)}
