"""redis+cluster://host:port[,host:port...]/?prefix=&ttl= backend: RedisStore over redis-py's RedisCluster.

Same keys as RedisStore. Their hash tag {<chunk key>} puts every object of a chunk (its
layers and its commit marker) in one hash slot, so one master holds the whole chunk: the
commit's EXISTS over the layers is a legal single-slot command, and replication moves a chunk
as one ordered stream, so a replica that has a chunk's marker has the layers written before
it. A chunk is committed or absent as a whole, on the master and after a failover alike.

Batched calls (get_layers, lookups, commits) go through the cluster pipeline: it groups the
commands by the node that owns their slot and writes to every node before reading any reply,
so the masters serve one batch in parallel, each with one round trip.

Failover: while a master is down and until a replica takes over its slots, calls on those
slots raise StoreUnavailable or StoreTimeout within the timeout (callers recompute; outputs
stay exact). Every such error makes the client re-read the slot map, so the next call goes to
the promoted replica and hits resume there. The client is built on first use: a store opened
while the cluster is unreachable works once it is back.
"""
from __future__ import annotations

import threading
from typing import Any
from urllib.parse import unquote, urlsplit

from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from pdserve.kvstore.base import KVStore
from pdserve.kvstore.redis_store import RedisStore


def parse_nodes(url: str) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    """Startup nodes and connection options of redis[s]+cluster://[user:pass@]host:port[,host:port...]/."""
    parts = urlsplit(url)
    creds, _, hosts = parts.netloc.rpartition("@")
    nodes = []
    for item in hosts.split(","):
        host, sep, port = item.strip().rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"cluster node {item!r} in {url!r} is not host:port")
        nodes.append((host.strip("[]"), int(port)))
    if parts.path not in ("", "/", "/0"):
        raise ValueError(f"a Redis Cluster has no databases: drop {parts.path!r} from {url!r}")
    options: dict[str, Any] = {"ssl": parts.scheme.lower().startswith("rediss")}
    if creds:
        user, sep, password = creds.partition(":")
        options.update(username=unquote(user) or None, password=unquote(password) if sep else None)
    return nodes, options


class RedisClusterStore(RedisStore):
    def __init__(self, url: str, **kwargs: Any) -> None:
        self.nodes, self._options = parse_nodes(url)
        self._connect_lock = threading.Lock()
        super().__init__(url, **kwargs)

    # Loads go through the cluster pipeline (one round trip per node, all nodes at once), then are copied.
    _get_spans = KVStore._get_spans
    _get_table = KVStore._get_table
    _get_whole = KVStore._get_whole

    def _connect(self) -> None:
        return None  # built on first use (see _redis): RedisCluster talks to the cluster when constructed

    @property
    def _redis(self) -> RedisCluster:
        client = self._client
        if client is None:
            with self._connect_lock:
                if self._client is None:
                    self._client = RedisCluster(
                        startup_nodes=[ClusterNode(host, port) for host, port in self.nodes],
                        socket_timeout=self.timeout, socket_connect_timeout=self.timeout,
                        retry=Retry(NoBackoff(), 1), require_full_coverage=False,
                        max_connections=self.max_connections, **self._options)
                client = self._client
        return client

    def _memory_infos(self) -> list[dict[str, Any]]:
        infos = self._redis.info("memory", target_nodes=RedisCluster.PRIMARIES)
        return list(infos.values()) if all(isinstance(v, dict) for v in infos.values()) else [infos]

    def _close(self) -> None:
        if self._client is not None:
            self._client.close()
