"""redis://host:port/db backend: pipelined batched GET/SET of binary values through a connection pool.

Keys: <prefix><fingerprint>:{<chunk key>}:<layer> for layer objects and ...:c for the commit
marker. The hash tag {<chunk key>} keeps all of a chunk in one Redis Cluster hash slot
(kvstore.redis_cluster), so the multi-key EXISTS/DEL of one chunk stays legal there and a
chunk is committed or absent as a whole. Eviction is Redis's own job (ttl here, or
maxmemory-policy allkeys-lru on the server; `bounds_warning` says when there is neither); a
layer evicted before its marker reads as NotFound, which callers treat like any other miss.

Loads read each value straight into the caller's staging buffer (kvstore.resp: no bytes object,
no copy per value); everything else goes through redis-py. Every socket operation is bounded by
`timeout`; a broken connection is retried once at
once (that is what reconnects a pooled connection after a Redis restart), so a dead server
surfaces as StoreUnavailable, a frozen one as StoreTimeout, and never as a hang.
"""
from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from pdserve.kvstore import object_format, resp
from pdserve.kvstore.base import KVStore
from pdserve.kvstore.errors import NotFound, StoreError, StoreTimeout, StoreUnavailable
from pdserve.kvstore.layout import WriterLayout, parse_object_layer
from pdserve.kvstore.gate import NO_GATE, WriteGate
from pdserve.kvstore.records import Buffer, ChunkInfo
from pdserve.kvstore.spans import SpanTable, scratch_table

# Replies that mean "this shard cannot serve right now" (a cluster mid-failover): an outage, not a bug.
_OUTAGE = (redis.ConnectionError, redis.exceptions.ClusterDownError, redis.exceptions.TryAgainError,
           redis.exceptions.ReadOnlyError, redis.exceptions.SlotNotCoveredError)

MARKER = "c"
_SCAN_BATCH = 256
_GET_BATCH = 16  # objects per pipelined GET when walking everything (bounds memory: ~16 MiB per batch)


class RedisStore(KVStore):
    _io_errors = (redis.RedisError, redis.exceptions.RedisClusterException)

    def __init__(self, url: str, *, ttl: int | None = None, prefix: str = "pdkv:", max_connections: int = 16,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if ttl is not None and ttl <= 0:
            raise ValueError(f"ttl must be a positive number of seconds, got {ttl}")
        self.url = url
        self.ttl = ttl
        self.prefix = prefix
        self.max_connections = max_connections
        self._client = self._connect()

    def _connect(self) -> Any:
        """The client (connects lazily: a store opened during an outage works once redis is back)."""
        pool = redis.BlockingConnectionPool.from_url(
            self.url, max_connections=self.max_connections, timeout=self.timeout, socket_timeout=self.timeout,
            socket_connect_timeout=self.timeout, retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)))
        return redis.Redis(connection_pool=pool)

    @property
    def _redis(self) -> Any:
        return self._client

    # ---- keys ----
    def _key(self, key: str, suffix: str | int, fingerprint: str | None = None) -> str:
        return f"{self.prefix}{fingerprint or self.fingerprint}:{{{key}}}:{suffix}"

    def object_name(self, key: str, layer: int) -> str:
        return self._key(key, layer)

    def _parse(self, raw: bytes) -> tuple[str, str, str] | None:
        """(fingerprint, chunk key, suffix) of one of our keys, None for anything else."""
        text = raw.decode(errors="replace")[len(self.prefix):]
        fp, sep, rest = text.partition(":{")
        key, sep2, suffix = rest.partition("}:")
        return (fp, key, suffix) if sep and sep2 else None

    # ---- hooks ----
    def _translate(self, exc: Exception) -> StoreError:
        where = self.url
        if isinstance(exc, redis.TimeoutError):
            return StoreTimeout(f"redis {where} did not answer within {self.timeout:.1f}s")
        if isinstance(exc, _OUTAGE) or "cannot be connected" in str(exc):  # the latter: no cluster node answers
            return StoreUnavailable(f"redis {where} unreachable: {exc}")
        return StoreError(f"redis {where}: {exc}")

    def bounds_warning(self) -> str | None:
        if self.ttl is not None:
            return None
        try:
            infos = self._calls.guard(self._memory_infos)
        except StoreError:  # unreachable or INFO not allowed: nothing to say
            return None
        unbounded = [i for i in infos if int(i.get("maxmemory", 0)) == 0]
        if unbounded:
            return (f"KV store {self.url} is unbounded: no ttl and redis maxmemory 0, so it grows with every "
                    f"prompt (start redis with --maxmemory <bytes> --maxmemory-policy allkeys-lru, or add ?ttl=<s>)")
        stuck = sorted({str(i.get("maxmemory_policy")) for i in infos
                        if not str(i.get("maxmemory_policy", "")).startswith("allkeys")})
        if stuck:
            return (f"KV store {self.url}: redis maxmemory-policy {','.join(stuck)} never evicts our keys (no ttl), "
                    f"so saves fail once redis is full (use allkeys-lru, or add ?ttl=<s>)")
        return None

    def _memory_infos(self) -> list[dict[str, Any]]:
        """INFO memory of every server holding our keys."""
        return [self._redis.info("memory")]

    def _lookup(self, keys: list[str]) -> list[tuple[str, WriterLayout | None]]:
        pipe = self._redis.pipeline(transaction=False)
        for key in keys:
            pipe.get(self._key(key, MARKER))  # as cheap as EXISTS, and the load that follows needs the layout
        found: list[tuple[str, WriterLayout | None]] = []
        for key, marker in zip(keys, pipe.execute()):
            if marker is None:
                break
            # an unreadable one (None) still counts: the load fails, repair heals
            found.append((key, self._model.admit(_layout(marker))))
        return found

    def _read_layouts(self, keys: list[str]) -> list[WriterLayout]:
        pipe = self._redis.pipeline(transaction=False)
        for key in keys:
            pipe.get(self._key(key, MARKER))
        layouts = []
        for key, marker in zip(keys, pipe.execute()):
            if marker is None:
                raise NotFound(f"{self._key(key, MARKER)}: chunk {key} is not committed")
            layouts.append(self._model.trusted(_layout(marker), self._key(key, MARKER)))
        return layouts

    def _put(self, layer: int | str, objects: list[tuple[str, bytes, list[memoryview]]]) -> None:
        pipe = self._redis.pipeline(transaction=False)
        for key, header, payload in objects:
            pipe.set(self._key(key, layer), b"".join((header, *payload)), ex=self.ttl)
        pipe.execute()

    def _get(self, items: list[tuple[int, str]]) -> list[Buffer]:
        pipe = self._redis.pipeline(transaction=False)
        for layer, key in items:
            pipe.get(self._key(key, layer))
        values = pipe.execute()
        missing = [item for item, value in zip(items, values) if value is None]
        if missing:
            layer, key = missing[0]
            raise NotFound(f"{len(missing)} object(s) missing, e.g. {self._key(key, layer)}")
        return values

    def _get_table(self, items: list[tuple[int, str]], table: SpanTable, shapes: list[tuple[int, ...]],
                   dtype: torch.dtype, gate: WriteGate) -> None:
        """_get_spans through the compiled receiver when there is one (kvstore.resp.get_table: framing,
        receives into the spans and xxh3 in C, through the gate), then the header checks; an object
        that is not exactly right is worked out by codec's checks, which say why."""
        reader = self.span_reader
        if reader is None:
            return self._get_spans(items, table.views(), shapes, dtype, gate)
        names = [self._key(key, layer) for layer, key in items]
        headers = np.empty(object_format.HEADER_SIZE * len(items), np.uint8)
        got = self._receive(names, table, headers, gate, reader)
        if got is None:  # TLS
            return self._get_spans(items, table.views(), shapes, dtype, gate, headers, table)
        sizes, digests = got
        all_headers = memoryview(headers)
        views = None
        for i, ((layer, key), name, size, shape) in enumerate(zip(items, names, sizes, shapes)):
            header = all_headers[object_format.HEADER_SIZE * i:object_format.HEADER_SIZE * (i + 1)]
            if size == object_format.HEADER_SIZE + table.totals[i] and object_format.header_and_digest_match(
                    header, digests[i], self.fingerprint, dtype, shape, key=key, layer=layer):
                continue
            if size is None:
                raise NotFound(f"{sum(s is None for s in sizes)} object(s) missing, e.g. {name}")
            views = views or table.views()
            object_format.check_size(name, size, views[i], shape, dtype)
            object_format.check_payload(header, views[i], self.fingerprint, dtype, shape, name, key=key, layer=layer)

    def _receive(self, names: list[str], table: SpanTable, headers: np.ndarray, gate: WriteGate,
                 reader: Any) -> tuple[list[int | None], list[int]] | None:
        """kvstore.resp.get_table; a dropped pooled connection (a redis restart) is retried once at once."""
        try:
            return resp.get_table(self._redis, names, table, headers, gate, reader)
        except redis.TimeoutError:
            raise
        except redis.ConnectionError:
            return resp.get_table(self._redis, names, table, headers, gate, reader)

    def _get_whole(self, items: list[tuple[int | str, str]], sizes: list[int], expect: bytes
                   ) -> tuple[list[memoryview], memoryview, list[int]] | None:
        """Coded objects of known payload sizes through the compiled receiver (kvstore.resp.get_table: framing,
        receive and xxh3 in C, the GIL released) into this thread's scratch, the batched coded load's read
        (kvstore/coded_reads.py); None without the receiver, on TLS, or when an object is not of its size."""
        reader = self.span_reader
        if reader is None or not items:
            return None
        scratch, table, offsets = scratch_table(sizes)
        headers = np.empty(object_format.HEADER_SIZE * len(items), np.uint8)
        got = self._receive([self._key(key, layer) for layer, key in items], table, headers, NO_GATE, reader)
        if got is None or any(size != object_format.HEADER_SIZE + want for size, want in zip(got[0], sizes)):
            return None
        return [scratch[a:b] for a, b in zip(offsets[:-1], offsets[1:])], memoryview(headers), got[1]

    def _get_spans(self, items: list[tuple[int, str]], spans: list[list[memoryview]], shapes: list[tuple[int, ...]],
                   dtype: torch.dtype, gate: WriteGate = NO_GATE, header_bytes: np.ndarray | None = None,
                   table: SpanTable | None = None) -> None:
        """One pipelined round trip whose values land in the spans (kvstore.resp); a dropped pooled
        connection (a redis restart) is retried once at once, like every other call. With `table` (the
        spans' SpanTable) and `header_bytes`, the headers land there and the compiled reader hashes."""
        names = [self._key(key, layer) for layer, key in items]
        if header_bytes is None:
            header_bytes = np.empty(object_format.HEADER_SIZE * len(items), np.uint8)
        all_headers = memoryview(header_bytes)
        headers = [all_headers[object_format.HEADER_SIZE * i:object_format.HEADER_SIZE * (i + 1)] for i in range(len(items))]
        views = [[header, *payload] for header, payload in zip(headers, spans)]
        try:
            sizes = resp.get_into(self._redis, names, views, gate)
        except redis.TimeoutError:
            raise
        except redis.ConnectionError:
            sizes = resp.get_into(self._redis, names, views, gate)
        missing = [name for name, size in zip(names, sizes) if size is None]
        if missing:
            raise NotFound(f"{len(missing)} object(s) missing, e.g. {missing[0]}")
        digests = None
        if table is not None and all(size == object_format.HEADER_SIZE + total for size, total in zip(sizes, table.totals)):
            digests = self.span_reader.hash(table.desc, table.first, table.bases(), header_bytes).tolist()
        for i, ((layer, key), name, size, header, payload, shape) in enumerate(zip(items, names, sizes, headers, spans,
                                                                                   shapes)):
            if digests is not None and object_format.header_and_digest_match(header, digests[i], self.fingerprint, dtype,
                                                                     shape, key=key, layer=layer):
                continue
            object_format.check_size(name, size, payload, shape, dtype)
            object_format.check_payload(header, payload, self.fingerprint, dtype, shape, name, key=key, layer=layer)

    def _commit(self, keys: list[str], layout: WriterLayout, part: int) -> None:
        heads = self._heads(layout)
        names = layout.object_layers(heads)
        own = names if layout.single else layout.part_objects(part, heads)
        pipe = self._redis.pipeline(transaction=False)
        for key in keys:
            pipe.exists(*(self._key(key, name) for name in own))
        complete = [key for key, n in zip(keys, pipe.execute()) if n == len(own)]
        ready = complete
        if not layout.single:  # this writer's part; the chunk once every part's marker is there
            parts = [f"{MARKER}.{name}" for name in layout.part_names(heads)]
            for key in complete:
                pipe.set(self._key(key, parts[part]), b"", ex=self.ttl)
                pipe.exists(*(self._key(key, name) for name in parts))
            found = pipe.execute()[1::2]
            ready = [key for key, n in zip(complete, found) if n == len(parts)]
            for key in ready:  # every part's marker follows its own objects: a check of the others' objects
                pipe.exists(*(self._key(key, name) for name in names))
            ready = [key for key, n in zip(ready, pipe.execute()) if n == len(names)]
        for key in ready:
            if self.ttl is not None:  # layers expire together with the marker, not before it
                for name in names:
                    pipe.expire(self._key(key, name), self.ttl)
            pipe.set(self._key(key, MARKER), layout.encode(), ex=self.ttl)
        pipe.execute()
        if len(complete) < len(keys):
            raise NotFound(f"{len(keys) - len(complete)} chunk(s) miss layers and stay invisible")

    def _heads(self, layout: WriterLayout) -> int:
        return layout.num_kv_heads or (self.kv_shape[0] if self.kv_shape else 0)

    def _names(self, key: str, marker: bytes | None, fingerprint: str | None = None) -> list[str]:
        """Every key of a chunk as its marker (or, without one this model's chunks can have, the store's layer
        count) says: its layer objects and its part markers."""
        layout = self._model.admit(_layout(marker))
        if layout is None:
            if not self.num_layers:
                return []
            layout = WriterLayout(self.num_layers)
        names: list[int | str] = list(layout.object_layers(self._heads(layout)))
        if not layout.single:
            names += [f"{MARKER}.{name}" for name in layout.part_names(self._heads(layout))]
        return [self._key(key, name, fingerprint) for name in names]

    def _delete(self, keys: list[str]) -> int:
        pipe = self._redis.pipeline(transaction=False)
        for key in keys:
            pipe.getdel(self._key(key, MARKER))
        markers = pipe.execute()
        for key, marker in zip(keys, markers):
            names = self._names(key, marker)
            if names:
                # one chunk's keys share a slot; the raw command, as cluster pipelines refuse unlink(*keys)
                pipe.execute_command("UNLINK", *names)
        pipe.execute()
        return sum(marker is not None for marker in markers)

    def _chunk_infos(self, fingerprint: str | None) -> Iterator[ChunkInfo]:
        chunks: dict[tuple[str, str], ChunkInfo] = {}
        for batch in self._scan_batches(fingerprint):
            pipe = self._redis.pipeline(transaction=False)
            for raw, _ in batch:
                pipe.strlen(raw)
                pipe.getrange(raw, 0, object_format.HEADER_SIZE - 1)
            replies = pipe.execute()
            for (_, (fp, key, suffix)), size, head in zip(batch, replies[::2], replies[1::2]):
                info = chunks.setdefault((fp, key), ChunkInfo(fp, key, False, 0, 0))
                if suffix == MARKER:
                    info.committed = True
                elif not suffix.startswith(MARKER + "."):  # a part marker is no object
                    info.count_object(size, head)
        yield from chunks.values()

    def _iter_objects(self, fingerprint: str | None) -> Iterator[tuple[str, str, int | str, str, Buffer]]:
        for batch in self._scan_batches(fingerprint, _GET_BATCH, layers_only=True):
            pipe = self._redis.pipeline(transaction=False)
            for raw, _ in batch:
                pipe.get(raw)
            for (raw, (fp, key, suffix)), value in zip(batch, pipe.execute()):
                if value is not None:  # expired while we walked
                    layer = parse_object_layer(suffix)
                    yield fp, key, -1 if layer is None else layer, raw.decode(errors="replace"), value

    def _clear(self, fingerprint: str | None) -> int:
        removed = 0
        for batch in self._scan_batches(fingerprint):
            removed += sum(1 for _, (_, _, suffix) in batch if _is_object(suffix))
            self._redis.unlink(*(raw for raw, _ in batch))
        return removed

    def _committed_chunks(self, fingerprint: str | None) -> Iterator[tuple[str, str]]:
        for batch in self._scan_batches(fingerprint):
            yield from ((fp, key) for _, (fp, key, suffix) in batch if suffix == MARKER)

    def _damage(self, fingerprint: str, key: str) -> tuple[str | None, list[int | str]]:
        marker = self._redis.get(self._key(key, MARKER, fingerprint))
        if marker is None:
            return None, []
        layout = _layout(marker)  # a layout (WriterLayout) holds at most MAX_CHUNK_OBJECTS objects
        reason = ("empty" if not marker else "corrupted") + " commit marker" if layout is None else \
            self._model.layout_damage(layout)
        if reason is not None:
            return reason, []
        names = layout.object_layers(self._heads(layout))
        pipe = self._redis.pipeline(transaction=False)
        for name in names:
            pipe.exists(self._key(key, name, fingerprint))
        missing = [name for name, n in zip(names, pipe.execute()) if not n]
        return (f"layer {missing[0]} of {layout.num_layers} missing" if missing else None), names

    def _uncommit(self, fingerprint: str, key: str) -> bool:
        # the marker goes first (the chunk is invisible from then on), then the chunk's layer objects
        marker = self._redis.getdel(self._key(key, MARKER, fingerprint))
        names = self._names(key, marker, fingerprint) if self._model.admit(_layout(marker)) else \
            list(self._redis.scan_iter(match=self._key(key, "*", fingerprint), count=_SCAN_BATCH))
        if names:
            self._redis.execute_command("UNLINK", *names)  # one chunk's keys share a slot
        return marker is not None

    def _close(self) -> None:
        self._redis.close()
        self._redis.connection_pool.disconnect()

    # ---- internals ----
    def _scan_batches(self, fingerprint: str | None, size: int = _SCAN_BATCH, layers_only: bool = False
                      ) -> Iterator[list[tuple[bytes, tuple[str, str, str]]]]:
        """Our keys (of one or all fingerprints) in batches, each with its parsed parts."""
        match = f"{self.prefix}{fingerprint or '*'}:*"
        batch = []
        for raw in self._redis.scan_iter(match=match, count=_SCAN_BATCH):
            parsed = self._parse(raw)
            if parsed is not None and not (layers_only and not _is_object(parsed[2])):
                batch.append((raw, parsed))
            if len(batch) >= size:
                yield batch
                batch = []
        if batch:
            yield batch


def _layout(marker: bytes | None) -> WriterLayout | None:
    """The writer layout a commit marker's value records (kvstore/layout.py); None when absent or unreadable."""
    if not marker:
        return None
    try:
        return WriterLayout.decode(marker.decode("ascii"))
    except (ValueError, UnicodeDecodeError):
        return None


def _is_object(suffix: str) -> bool:
    """Whether a key's suffix names a layer object (not the commit marker or a part marker)."""
    return suffix != MARKER and not suffix.startswith(MARKER + ".")

