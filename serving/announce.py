"""A node's place in the fleet registry: it announces itself in Redis while it accepts requests.

The registry is plain Redis keys with a TTL (no broker of our own): each node SETs
`pdserve:fleet:<role>:<grpc address>` to its `Announcement` (JSON) with a TTL of `TTL_S`, again every
`REFRESH_S`, and adds the key to the set `pdserve:fleet` in the same transaction (the index proxies read:
listing the fleet costs O(fleet), not a SCAN over a store's millions of chunk keys). A node that dies
stops refreshing and its key expires. A node that drains (SIGTERM) rewrites its key first, the moment
its engine stops accepting, as `draining` for one last TTL: every proxy polling the registry drops it at
once and can say why (a deleted key would read the same as an expired one), while its streams finish.
A `--role auto` node that the planner moves (SetRole) does the same to its old key, naming the role it
switched to, and announces under its new role's key at once (`Announcer.change_role`).
This module owns the key names and the JSON both sides read (pd-proxy's reader: proxy/fleet_sources.py).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from dataclasses import MISSING, asdict, dataclass, fields, replace
from typing import Any, Callable
from urllib.parse import urlsplit, urlunsplit

logger = logging.getLogger(__name__)

INDEX_KEY = "pdserve:fleet"  # the set of every announced node's key
KEY_PREFIX = INDEX_KEY + ":"
TTL_S = 3.0  # a node silent this long has left the fleet
REFRESH_S = 1.0  # three refreshes per TTL: one lost write (a slow Redis) does not drop a live node
_WATCH_S = 0.1  # how often the announcer looks at whether the engine still accepts: a drain withdraws at once
_WILDCARDS = ("0.0.0.0", "::", "")


@dataclass(frozen=True)
class Announcement:
    """What a node tells the fleet about itself (the registry key's JSON value)."""

    address: str  # gRPC host:port, as proxies dial it
    http_address: str  # host:port of its OpenAI API and /metrics
    role: str  # prefill | decode
    model: str  # the served model name
    fingerprint: str  # common/hashing.py model_fingerprint: nodes with different ones never share KV
    tensor_parallel_size: int
    pipeline_parallel_size: int
    kv_store: str  # credentials left out
    started_at: float  # Unix time the node started announcing
    draining: bool = False  # the node's last word: it takes no new requests
    switchable: bool = False  # started with --role auto: the proxy's planner may move it (SetRole)
    next_role: str = ""  # draining because it switched roles: the role it announces next

    @property
    def key(self) -> str:
        return fleet_key(self.role, self.address)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Announcement:
        """ValueError (or KeyError / TypeError as ValueError) for a value that is not one."""
        try:
            data = json.loads(text)
            return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data or f.default is MISSING})
        except (KeyError, TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"not a fleet announcement: {e}") from None


def fleet_key(role: str, address: str) -> str:
    return f"{KEY_PREFIX}{role}:{address}"


def without_credentials(url: str) -> str:
    """`url` with any user:password@ removed: announcements and /fleet are readable by anyone who can look."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def add_fleet_args(parser: argparse.ArgumentParser) -> None:
    """A node's fleet flags (pd-prefill, pd-decode)."""
    g = parser.add_argument_group("fleet")
    g.add_argument("--fleet-registry", default=None, metavar="redis://HOST:PORT/DB",
                   help=f"announce this node in a Redis fleet registry while it serves (key {KEY_PREFIX}ROLE:ADDRESS,"
                        f" refreshed every {REFRESH_S:g} s, expiring after {TTL_S:g} s; marked draining on SIGTERM), so"
                        " a pd-proxy given the same --fleet-registry finds it")
    g.add_argument("--advertise-address", default=None, metavar="HOST",
                   help="the address proxies reach this node at (default: --host; required when --host is a wildcard "
                        "such as 0.0.0.0)")


def advertised_host(args: argparse.Namespace) -> str:
    """The host a node announces; ValueError when there is none to give (a wildcard --host, no --advertise-address)."""
    host = args.advertise_address or args.host
    if host in _WILDCARDS:
        raise ValueError(f"--fleet-registry with --host {args.host or '(any)'} needs --advertise-address: proxies "
                         "cannot dial a wildcard address")
    return host


def check_registry(url: str, timeout_s: float = 3.0, what: str = "fleet registry") -> None:
    """One PING; ValueError with the reason when `what` (the registry, or the KV events' Redis) cannot be
    reached (a start-up check)."""
    import redis

    try:
        client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        try:
            client.ping()
        finally:
            client.close()
    except (redis.RedisError, ValueError, OSError) as e:
        raise ValueError(f"{what} {without_credentials(url)} unusable: {e}") from None


class Announcer:
    """Keeps `announcement` in the registry while `accepting()` holds; withdraws it when that stops, and on stop().

    A registry that fails is logged once (and its recovery once): the node keeps serving, and proxies
    drop it after TTL_S until a write goes through again."""

    def __init__(self, url: str, announcement: Announcement, accepting: Callable[[], bool],
                 ttl_s: float = TTL_S, refresh_s: float = REFRESH_S) -> None:
        import redis.asyncio

        self.url = url
        self.announcement = announcement
        self.accepting = accepting
        self.ttl_ms = int(ttl_s * 1000)
        self.refresh_s = refresh_s
        self.client: Any = redis.asyncio.Redis.from_url(url, socket_timeout=refresh_s, socket_connect_timeout=refresh_s)
        self.announced = False
        self._failing: str | None = None
        self._task: asyncio.Task | None = None
        self._lock = asyncio.Lock()  # a role change's withdraw + announce never interleaves with a refresh

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self.accepting():
                async with self._lock:
                    await self._write(self._announce)
                next_write = loop.time() + self.refresh_s
                while self.accepting() and loop.time() < next_write:
                    await asyncio.sleep(_WATCH_S)
            else:
                if self.announced:
                    await self._write(self._withdraw)
                await asyncio.sleep(_WATCH_S)

    async def _announce(self) -> None:
        a = self.announcement
        async with self.client.pipeline(transaction=True) as pipe:  # the key and its index entry together
            await pipe.set(a.key, a.to_json(), px=self.ttl_ms).sadd(INDEX_KEY, a.key).execute()
        if not self.announced:
            logger.info("%s announced as a %s node in the fleet registry %s (model %s, refreshed every %g s, "
                        "expires after %g s)", a.address, a.role, without_credentials(self.url), a.model,
                        self.refresh_s, self.ttl_ms / 1000)
        self.announced = True

    async def change_role(self, role: str) -> None:
        """Announce the node under `role` (SetRole): its old key is marked draining, naming the new role, so
        every proxy drops it from the old role's list at its next poll and adds it under the new key."""
        async with self._lock:
            old = self.announcement
            if self.announced:
                await self._write(lambda: self._withdraw(next_role=role))
            self.announcement = replace(old, role=role)
            if self.accepting():
                await self._write(self._announce)
        logger.info("%s announced as %s instead of %s in the fleet registry %s", old.address, role, old.role,
                    without_credentials(self.url))

    async def _withdraw(self, next_role: str = "") -> None:
        a = replace(self.announcement, draining=True, next_role=next_role)
        async with self.client.pipeline(transaction=True) as pipe:  # expires like any key; no refresh follows
            await pipe.set(a.key, a.to_json(), px=self.ttl_ms).sadd(INDEX_KEY, a.key).execute()
        self.announced = False
        if not next_role:  # a role change says it once, in change_role
            logger.info("%s withdrawn from the fleet registry %s: proxies stop routing to it", a.address,
                        without_credentials(self.url))

    async def _write(self, step: Callable[[], Any]) -> None:
        import redis

        try:
            await step()
        except (redis.RedisError, OSError) as e:
            if self._failing is None:
                logger.warning("%s: fleet registry %s failed (%s); proxies drop this node after %g s until a "
                               "write goes through", self.announcement.address, without_credentials(self.url),
                               e, self.ttl_ms / 1000)
            self._failing = str(e)
            return
        if self._failing is not None:
            logger.info("%s: fleet registry %s answers again", self.announcement.address,
                        without_credentials(self.url))
            self._failing = None

    async def stop(self) -> None:
        """Withdraw (if still announced) and close: the node is going away. Bounded by the client's socket timeout."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        try:
            if self.announced:
                await self._write(self._withdraw)
        finally:
            await self.client.aclose()


def announcement_of(server: Any, role: str, host: str, grpc_port: int, http_port: int, args: argparse.Namespace,
                    kv_store: str | None, switchable: bool = False) -> Announcement:
    """A running node's announcement: its model's fingerprint and names from the engine, its layout from `args`."""
    return Announcement(address=host_port(host, grpc_port), http_address=host_port(host, http_port), role=role,
                        model=server.served_names[0], fingerprint=server.engine.kv_cache_manager.fingerprint,
                        tensor_parallel_size=args.tensor_parallel_size or 1,
                        pipeline_parallel_size=args.pipeline_parallel_size or 1,
                        kv_store=without_credentials(kv_store or args.lmcache_config or ""), started_at=time.time(),
                        switchable=switchable)


def node_announcer(args: argparse.Namespace, server: Any, role: str,
                   http_port: int) -> Callable[[int], Announcer] | None:
    """What serve_with_grpc calls with its bound gRPC port to announce the node; None without --fleet-registry."""
    if not args.fleet_registry:
        return None
    host = advertised_host(args)

    def announcer(grpc_port: int) -> Announcer:
        announcement = announcement_of(server, role, host, grpc_port, http_port, args, args.kv_store,
                                       getattr(args, "role", None) == "auto")
        return Announcer(args.fleet_registry, announcement, lambda: server.async_engine.accepting)

    return announcer
