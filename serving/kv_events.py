"""KV events: what enters and leaves a node's prefix cache (and what it commits to the store), published as
chunk keys on a Redis stream that pd-proxy's `kv-aware` policy routes from (proxy/kv_index.py).

vLLM publishes BlockStored/BlockRemoved over ZeroMQ (`--kv-events-config`); this is the same idea on the
Redis a fleet already runs. Names are the store's own chunk keys (common/hashing.py `chunk_keys`: the hash
chain over `chunk_size`-token pieces), so a node's local prefixes and the store's are comparable: a chunk
counts as held locally once every one of its blocks is in the prefix cache, and as gone once any is evicted.

Threads: the engine's step thread only appends to a bounded queue (`blocks_stored` copies the prompt prefix
it needs, nothing more); one publisher thread hashes, batches every `interval_s` and XADDs one entry per
batch (compact JSON, never pickle) to the stream `STREAM`, trimmed with MAXLEN ~ so it stays bounded. A full
queue drops the event and counts it; a dropped event or a failed XADD makes the next batch a snapshot of
every chunk the node holds (checked against the prefix cache itself), as does (re)starting and every
`SNAPSHOT_S`. A lost event can thus only make a route worse until then, never an answer wrong.

One stream entry: {"v": 1, "node": "<gRPC host:port>", "boot": "<per process>", "seq": n, "fp": "<model
fingerprint>", "chunk": chunk_size, "events": [{"kind": "stored" | "removed" | "store_committed" |
"snapshot" | "cleared", "keys": ["<hex>", ...]}, ...]} under the field `b`. A snapshot replaces the node's
entries; `cleared` empties them.
"""
from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections import deque
from typing import Any, Callable

from pdserve.common.hashing import chunk_keys
from pdserve.serving.announce import without_credentials

logger = logging.getLogger(__name__)

STREAM = "pdserve:kv-events"  # one stream per fleet (per Redis database)
STREAM_MAXLEN = 100_000  # entries (batches) kept, approximately: XADD MAXLEN ~
FIELD = "b"
INTERVAL_S = 0.05  # one batch per this much time at most
SNAPSHOT_S = 30.0  # a full snapshot this often too: a proxy that started late, or lost entries, catches up
MAX_QUEUE = 10_000  # events waiting for the publisher thread; beyond: dropped, counted, snapshot follows
_TIMEOUT_S = 2.0  # every Redis call's deadline


class KVEventPublisher:
    """A PrefixCacheListener (engine/kv_cache_manager.py) that publishes what it is told."""

    def __init__(self, url: str, node: str, fingerprint: str, block_size: int, chunk_size: int,
                 cached_hashes: Callable[[], set[bytes]], *, interval_s: float = INTERVAL_S,
                 snapshot_s: float = SNAPSHOT_S, max_queue: int = MAX_QUEUE, client: Any = None) -> None:
        import redis

        self.url, self.node, self.fingerprint = url, node, fingerprint
        self.block_size, self.chunk_size = block_size, chunk_size
        self.blocks_per_chunk = chunk_size // block_size
        self.cached_hashes = cached_hashes  # the prefix cache's hashes now (read off the step thread: a peek)
        self.interval_s, self.snapshot_s, self.max_queue = interval_s, snapshot_s, max_queue
        self.client = client or redis.Redis.from_url(url, socket_timeout=_TIMEOUT_S,
                                                     socket_connect_timeout=_TIMEOUT_S)
        self.boot = uuid.uuid4().hex[:12]
        self.seq = 0
        self.published = 0  # batches
        self.dropped = 0  # events the full queue refused
        self._queue: deque[tuple[str, Any]] = deque()
        self._wake = threading.Condition()
        self._resync = True  # the first batch is a snapshot (an empty one: a restarted node's old entries go)
        self._stop = False
        self._failing: str | None = None
        self._next_snapshot = 0.0
        # The publisher thread's picture: which chunks it said are held, and the block hashes each needs.
        self._chunk_blocks: dict[str, tuple[bytes, ...]] = {}
        self._block_chunk: dict[bytes, str] = {}
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)

    # ------------------------------------------------------------ step thread: enqueue only
    def blocks_stored(self, request: Any, start: int, end: int) -> None:
        first, last = start // self.blocks_per_chunk, end // self.blocks_per_chunk
        if last <= first:
            return  # no chunk completed
        tokens = request.all_token_ids[:last * self.chunk_size]
        hashes = request.block_hashes[first * self.blocks_per_chunk:last * self.blocks_per_chunk]
        self._put(("stored", (tokens, request.cache_salt, getattr(request, "lora_fingerprint", None), first,
                              hashes)))

    def blocks_removed(self, block_hashes: list[bytes]) -> None:
        self._put(("removed", block_hashes))

    def cache_cleared(self) -> None:
        self._put(("cleared", None))

    def store_committed(self, keys: list[str]) -> None:
        """The store connector committed these chunk keys (its I/O thread)."""
        self._put(("store_committed", list(keys)))

    def _put(self, event: tuple[str, Any]) -> None:
        if len(self._queue) >= self.max_queue:  # never block a step: drop, count, resync with a snapshot
            self.dropped += 1
            self._resync = True
            return
        self._queue.append(event)  # deque.append is atomic: no lock on the step thread

    # ------------------------------------------------------------ the publisher thread
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = _TIMEOUT_S) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout_s)
        self.client.close()

    def _run(self) -> None:
        while True:
            with self._wake:
                self._wake.wait(self.interval_s)
                stopping = self._stop
            self.flush()
            if stopping:
                return

    def flush(self) -> None:
        """Turn what is queued into one batch and publish it (the thread's work; tests call it directly)."""
        events: list[dict[str, Any]] = []
        while self._queue:
            events.extend(self._translate(*self._queue.popleft()))
        now = time.monotonic()
        if self._resync or now >= self._next_snapshot:
            self._resync = False
            events = [{"kind": "snapshot", "keys": self._snapshot()}] + [e for e in events
                                                                         if e["kind"] == "store_committed"]
            self._next_snapshot = now + self.snapshot_s
        if events:
            self._publish(events)

    def _translate(self, kind: str, payload: Any) -> list[dict[str, Any]]:
        if kind == "stored":
            tokens, salt, lora, first, hashes = payload
            keys = chunk_keys(self.fingerprint, tokens, self.chunk_size, salt, lora)[first:]
            for i, key in enumerate(keys):
                blocks = tuple(hashes[i * self.blocks_per_chunk:(i + 1) * self.blocks_per_chunk])
                self._chunk_blocks[key] = blocks
                for h in blocks:
                    self._block_chunk[h] = key
            return [{"kind": "stored", "keys": keys}] if keys else []
        if kind == "removed":
            gone = []
            for h in payload:
                key = self._block_chunk.pop(h, None)
                if key is not None and self._chunk_blocks.pop(key, None) is not None:
                    gone.append(key)
            return [{"kind": "removed", "keys": gone}] if gone else []
        if kind == "cleared":
            self._chunk_blocks.clear()
            self._block_chunk.clear()
            return [{"kind": "cleared", "keys": []}]
        return [{"kind": "store_committed", "keys": payload}]

    def _snapshot(self) -> list[str]:
        """Every chunk this thread believes held, checked against the prefix cache (missed evictions drop out)."""
        cached = self.cached_hashes()
        for key in [k for k, blocks in self._chunk_blocks.items() if not all(h in cached for h in blocks)]:
            for h in self._chunk_blocks.pop(key):
                if self._block_chunk.get(h) == key:
                    del self._block_chunk[h]
        return list(self._chunk_blocks)

    def _publish(self, events: list[dict[str, Any]]) -> None:
        import redis

        self.seq += 1
        batch = {"v": 1, "node": self.node, "boot": self.boot, "seq": self.seq, "fp": self.fingerprint,
                 "chunk": self.chunk_size, "events": events}
        try:
            self.client.xadd(STREAM, {FIELD: json.dumps(batch, separators=(",", ":"))}, maxlen=STREAM_MAXLEN,
                             approximate=True)
        except (redis.RedisError, OSError) as e:
            self._resync = True  # this batch is lost: the next one is a snapshot
            if self._failing is None:
                logger.warning("%s: KV events to %s failed (%s); a snapshot follows once it answers", self.node,
                               without_credentials(self.url), e)
            self._failing = str(e)
            return
        self.published += 1
        if self._failing is not None:
            logger.info("%s: KV events to %s flow again", self.node, without_credentials(self.url))
            self._failing = None


def node_publisher(url: str | None, engine: Any, node: str) -> KVEventPublisher | None:
    """The publisher of a node's engine, started and attached as its prefix cache's listener; None without a URL."""
    if not url:
        return None
    kv = engine.kv_cache_manager
    chunk_size = engine.config.kv_transfer.chunk_size
    if chunk_size % kv.block_size:  # keys_for's chunks must be whole blocks (engine/config.py checks it with a store)
        chunk_size = kv.block_size
    # set(dict) copies the keys in one C call (bytes hashes are cached, no Python code runs), so the GIL is never
    # released mid-copy and the step thread cannot change the dict under it: a consistent peek without a lock.
    publisher = KVEventPublisher(url, node, kv.fingerprint, kv.block_size, chunk_size,
                                 lambda: set(kv.pool.cached))
    publisher.start()
    kv.set_listener(publisher)
    connector = engine.connector
    if connector is not None and hasattr(connector, "on_commit"):
        connector.on_commit = publisher.store_committed
    logger.info("%s: KV events to %s stream %s (chunks of %d tokens, a batch per %g ms at most, a snapshot every "
                "%g s)", node, without_credentials(url), STREAM, chunk_size, INTERVAL_S * 1e3, SNAPSHOT_S)
    return publisher
