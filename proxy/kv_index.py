"""The proxy's global prefix index, fed by the nodes' KV events (serving/kv_events.py; consumer:
proxy/kv_events_consumer.py), so `kv-aware` routes with no RPC on a request's path.

Keys are the store's chunk keys (common/hashing.py `chunk_keys`). The index holds
- chunk key -> the nodes (gRPC addresses) holding that chunk in their prefix cache, an LRU bounded by
  `max_chunks` (a chunk evicted from the index just stops attracting requests);
- the chunk keys the shared store committed, an LRU of the same bound;
- per node: its chunk keys (so a node that leaves costs its own entries, not a scan), its model fingerprint
  and chunk size (what a request's keys are computed with), and the last batch seen (boot id, seq).

A lookup walks the request's chunk keys in order, narrowing the set of nodes that held every chunk so
far: one dict lookup per chunk, set work bounded by the nodes that hold the prefix; nodes that hold none of
it cost nothing. `ops` counts that work (the tests' measure that routing cost does not grow with the fleet).

Whatever the events say, an answer can never be wrong: a node the index wrongly credits recomputes or
loads the prefix; one it wrongly misses is merely not preferred.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable

logger = logging.getLogger(__name__)

MAX_CHUNKS = 1_000_000  # chunk keys held per LRU (450-650 bytes each with its node set, as benchmarks/fleet_sim.py
                         # measures: ~0.5-0.65 GB at the bound)


@dataclass
class NodeEntry:
    fingerprint: str
    chunk_size: int
    boot: str
    seq: int
    chunks: set[str] = field(default_factory=set)


class KVIndex:
    def __init__(self, max_chunks: int = MAX_CHUNKS) -> None:
        self.max_chunks = max_chunks
        self._local: OrderedDict[str, set[str]] = OrderedDict()  # chunk key -> node addresses (LRU order)
        self._store: OrderedDict[str, None] = OrderedDict()  # committed chunk keys (LRU order)
        self.nodes: dict[str, NodeEntry] = {}
        self.ops = 0  # lookup work: dict lookups + set elements touched
        self.batches = 0
        self.gaps = 0  # batches missed (a seq jump: trimmed or lost), each repaired by the node's next snapshot
        self.duplicates = 0  # batches seen before (ignored)
        self.params_version = 0  # bumped when a node's (fingerprint, chunk size) appears, changes or goes: routers
                                 # regroup their nodes then, not on every request

    # ------------------------------------------------------------ events
    def apply(self, batch: dict[str, Any]) -> None:
        """One stream entry (serving/kv_events.py's format); ValueError for a malformed one (nothing applied)."""
        try:
            node, boot, seq = str(batch["node"]), str(batch["boot"]), int(batch["seq"])
            fp, chunk = str(batch["fp"]), int(batch["chunk"])
            events = [(str(e["kind"]), [str(k) for k in e["keys"]]) for e in batch["events"]]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a KV event batch: {e!r}") from None
        entry = self.nodes.get(node)
        snapshot = any(kind == "snapshot" for kind, _ in events)
        if entry is not None and entry.boot == boot:
            if seq <= entry.seq:
                self.duplicates += 1
                return
            if seq > entry.seq + 1 and not snapshot:
                self.gaps += 1
                logger.info("%s: KV events %d..%d missed; its next snapshot repairs the index", node, entry.seq + 1,
                            seq - 1)
        else:  # a node heard from first, or restarted (a new process): its old entries are void
            if entry is not None:
                self.drop_node(node)
            entry = self.nodes[node] = NodeEntry(fp, chunk, boot, seq)
            self.params_version += 1
            if seq > 1 and not snapshot:  # joined its stream midway (trimmed): its periodic snapshot fills in
                self.gaps += 1
        if (entry.fingerprint, entry.chunk_size) != (fp, chunk):
            self.params_version += 1
        entry.fingerprint, entry.chunk_size, entry.seq = fp, chunk, seq
        self.batches += 1
        for kind, keys in events:
            self._apply_one(node, entry, kind, keys)

    def _apply_one(self, node: str, entry: NodeEntry, kind: str, keys: list[str]) -> None:
        if kind in ("snapshot", "cleared"):
            self._forget(node, entry.chunks)
            entry.chunks = set()
        if kind in ("stored", "snapshot"):
            for key in keys:
                self._local.setdefault(key, set()).add(node)
                self._local.move_to_end(key)
                entry.chunks.add(key)
            self._trim(self._local)
        elif kind == "removed":
            self._forget(node, keys)
            entry.chunks.difference_update(keys)
        elif kind == "store_committed":
            for key in keys:
                self._store[key] = None
                self._store.move_to_end(key)
            self._trim(self._store)
        elif kind == "store_evicted":
            for key in keys:
                self._store.pop(key, None)

    def _forget(self, node: str, keys: Iterable[str]) -> None:
        for key in list(keys):
            holders = self._local.get(key)
            if holders is not None:
                holders.discard(node)
                if not holders:
                    del self._local[key]

    def _trim(self, lru: OrderedDict[str, Any]) -> None:
        while len(lru) > self.max_chunks:
            key, holders = lru.popitem(last=False)
            if isinstance(holders, set):
                for node in holders:
                    if (entry := self.nodes.get(node)) is not None:
                        entry.chunks.discard(key)

    def drop_node(self, node: str) -> None:
        """The node left the fleet: nothing is routed to it for its prefixes any more."""
        entry = self.nodes.pop(node, None)
        if entry is not None:
            self.params_version += 1
            self._forget(node, entry.chunks)
            logger.info("%s: its %d chunks left the KV index", node, len(entry.chunks))

    # ------------------------------------------------------------ lookups
    def params(self, node: str) -> tuple[str, int] | None:
        """(fingerprint, chunk size) the node's keys are computed with; None for a node never heard from."""
        entry = self.nodes.get(node)
        return (entry.fingerprint, entry.chunk_size) if entry is not None else None

    def local_chunks(self, keys: list[str], among: set[str]) -> dict[str, int]:
        """For each node of `among` holding the first chunk: how many leading chunks of `keys` it holds.

        Each node's depth is written once, when it drops out of the walk or at its end (not once per chunk): a
        document held by many nodes costs the intersections (in C) plus one entry per holder."""
        depth: dict[str, int] = {}
        alive: set[str] = set()
        walked = 0
        for i, key in enumerate(keys):
            self.ops += 1
            holders = self._local.get(key)
            if not holders:
                break
            self.ops += min(len(holders), len(alive) if i else len(among))
            still = (holders & among) if not i else (alive & holders)
            if len(still) < len(alive):
                depth.update(dict.fromkeys(alive - still, i))  # held chunks 0..i-1, not chunk i
            alive = still
            if not alive:
                break
            self._local.move_to_end(key)  # a prefix in use stays in the index
            walked = i + 1
        depth.update(dict.fromkeys(alive, walked))
        return depth

    def store_chunks(self, keys: list[str]) -> int:
        """How many leading chunks of `keys` the store committed (as far as the events said)."""
        n = 0
        for key in keys:
            self.ops += 1
            if key not in self._store:
                break
            n += 1
        return n

    def status(self) -> dict[str, Any]:
        return {"chunks": len(self._local), "store_chunks": len(self._store), "max_chunks": self.max_chunks,
                "nodes": {n: len(e.chunks) for n, e in self.nodes.items()}, "batches": self.batches,
                "gaps": self.gaps, "duplicates": self.duplicates}
