"""The KV store interface that connectors build on: small, batched, typed errors.

Data model. A prompt is cut into chunks of C tokens (common.hashing.chunk_keys gives their
keys; the last chunk may be partial). Each chunk is stored as one object per layer, holding
a tensor [2, n_tokens, num_kv_heads, head_dim] (K and V) in the codec format (kvstore.codec),
plus a commit marker written after all of its layers. A chunk is *present* only once its
marker exists, so readers never see a chunk whose layers are incomplete. Every object is
bound to the (chunk key, layer) it was written under: one found under another name is
CorruptObject, never another prompt's KV.

Usage (one store per model: it is opened for one fingerprint, layer count and dtype)::

    store = open_store("file:///mnt/kv?max_bytes=64GiB", fingerprint=fp, num_layers=32,
                       dtype=torch.bfloat16, kv_shape=(8, 128), timeout=5.0)
    # save (prefill): all layers, then commit
    for i in range(32):
        store.put_layer(i, {key: kv_i for key, kv_i in ...})    # several chunks per call
    store.commit(keys)                                           # after every layer of them
    # load (decode)
    n = store.lookup(keys)                                       # leading committed chunks
    kv = store.get_layer(i, keys[:n])                            # list of [2, n_tok, H, D]
    store.get_layer(i, keys[:n], out=staging)                    # or into reused CPU tensors
    store.get_layer_into(i, keys[:n], buf, chunk_lens)           # or into one reused [2, T, H, D]
                                                                 # buffer
    store.get_layer_spans(i, keys[:n], spans, chunk_lens, gate)  # or straight into paged KV blocks,
                                                                 # written only inside the load's gate
                                                                 # (kvstore.gate; the decode hot path)

Batched loads (the decode hot path: all chunks of a prompt, many layers, one call)::

    # staging: per layer one reusable (pinned) buffer [2, T, H, D] holding the chunks in token order
    out = [[staging[i][:, a:b] for a, b in chunk_token_ranges] for i in range(num_layers)]
    futures = store.get_layers_async(range(num_layers), keys, out=out)   # one Future per layer
    for i, fut in enumerate(futures):
        store.result(fut, remaining_s)       # layer i complete (StoreError / StoreTimeout otherwise)
        scatter(staging[i][:, lo:hi], slots)  # one copy per layer into paged memory

  get_layers(layers, keys, out=None) -> list[list[Tensor]]  (result[i][j]: layer layers[i] of keys[j])
      Reads every (layer, chunk) object in one call: one pipelined round trip on redis (on a
      cluster: one pipeline per node, sent to all nodes before any reply is read).
  get_layers_async(layers, keys, out=None) -> list[Future]  (future i -> get_layers' row i)
      One task per layer on the store's I/O pool, queued in `layers` order, so early layers
      finish first and several layers are read at once (io_threads parallel connections on
      redis). A future that has not started can be cancel()ed (e.g. after an earlier layer
      failed: the request recomputes anyway).
  out[i][j] is the destination of layer layers[i] of chunk keys[j]: a CPU tensor (pinned or not)
      of the store's dtype and shape [2, n_tokens_j, H, D] whose K half and V half are each
      contiguous, e.g. a token slice staging[:, a:b] of a [2, T, H, D] buffer. Files are read
      straight into it (readv, no intermediate copy); redis replies are copied into it. The
      returned tensors are those `out` tensors. Without `out`, fresh tensors are returned
      (aliasing the reply bytes on redis: read-only, no copy). Either way every object's
      header, key binding and xxh3 checksum are checked before its future resolves; an error
      in any object fails that layer's call/future (NotFound, CorruptObject, ...).

Overlapping other I/O with compute: `submit(fn, ...)` runs anything on the store's thread
pool and returns a concurrent.futures.Future; `result(future, timeout)` waits and turns a
timeout into StoreTimeout. Wait for every put of a chunk before committing it. All methods
are thread-safe.

Errors (kvstore.errors): StoreUnavailable (backend unreachable), StoreTimeout, CorruptObject
(any validation failure, never garbage data), NotFound (object missing: evicted, expired or
never written). Every one means "recompute" to a caller. Redis calls are bounded by socket
timeouts; filesystem calls are plain syscalls, so bound a possibly hung NFS mount by
waiting on a submitted call with a timeout.

Bounds: `bounds_warning()` is one line when a shared store can grow without limit (redis with
no ttl and no maxmemory, or a policy that never evicts our keys), else None; nodes log it at
start-up. (A file store without max_bytes grows until its disk is full; it is the nodes' quiet
default: pass ?max_bytes= to bound it.)

Administration (any fingerprint, used by the `pd-kvstore` CLI): inventory(), list_chunks(),
verify(), clear(). stats() returns this process's counters.
"""
from __future__ import annotations

import concurrent.futures
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from pdserve.kvstore import codec
from pdserve.kvstore.errors import CorruptObject, StoreError, StoreTimeout
from pdserve.kvstore.gate import NO_GATE, WriteGate
from pdserve.kvstore.native_reader import native_reader
from pdserve.kvstore.spans import SpanReader, SpanTable, copy_into

Buffer = bytes | bytearray | memoryview
_UNSET: Any = object()


@dataclass
class StoreStats:
    """This process's counters since the store was opened."""

    lookups: int = 0
    lookup_chunks: int = 0
    hit_chunks: int = 0
    objects_written: int = 0
    bytes_written: int = 0
    write_seconds: float = 0.0
    objects_read: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0
    chunks_committed: int = 0
    chunks_deleted: int = 0
    errors: int = 0


@dataclass
class Usage:
    """What one model fingerprint occupies in the backend."""

    chunks: int = 0  # committed chunks
    objects: int = 0  # layer objects (committed or not)
    bytes: int = 0  # bytes of layer objects


@dataclass
class ChunkInfo:
    fingerprint: str
    key: str
    committed: bool
    objects: int  # layer objects present
    bytes: int


@dataclass
class VerifyReport:
    objects: int = 0
    bytes: int = 0
    corrupt: list[str] = field(default_factory=list)  # "<name>: <reason>" per bad object


class KVStore(ABC):
    """A chunked, per-layer KV store bound to one model fingerprint (see the module docstring)."""

    def __init__(self, fingerprint: str | None = None, num_layers: int | None = None,
                 dtype: torch.dtype | str | None = None, kv_shape: Sequence[int] | None = None,
                 timeout: float = 5.0, io_threads: int = 4) -> None:
        if fingerprint is not None:
            codec.fingerprint_bytes(fingerprint)
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self.fingerprint = fingerprint
        self.num_layers = num_layers
        self.dtype = codec.as_dtype(dtype) if dtype is not None else None
        self.kv_shape = tuple(kv_shape) if kv_shape is not None else None
        self.timeout = float(timeout)
        self._stats = StoreStats()
        self._lock = threading.Lock()
        self.io_threads = io_threads  # the I/O pool's threads: how many reads may run at once
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="kvstore-io")

    _span_reader: Any = _UNSET

    @property
    def span_reader(self) -> SpanReader | None:
        """The compiled reader of loads into spans (kvstore/native_reader.py), taken at the first load that
        asks; None: the Python paths (PDSERVE_KERNELS=torch, or no library here). Tests and benchmarks
        set it to choose a path."""
        if self._span_reader is _UNSET:
            self._span_reader = native_reader()
        return self._span_reader

    @span_reader.setter
    def span_reader(self, reader: SpanReader | None) -> None:
        self._span_reader = reader

    # ---- data path (needs a fingerprint) ----
    def lookup(self, keys: Sequence[str]) -> int:
        """Number of leading chunks of `keys` that are committed (the longest present prefix)."""
        self._bound()
        hits = self._guard(self._lookup, list(keys))
        self._count(lookups=1, lookup_chunks=len(keys), hit_chunks=hits)
        return hits

    def put_layer(self, layer: int, chunks: Mapping[str, torch.Tensor]) -> None:
        """Write layer `layer` of several chunks: {chunk key: [2, n_tokens, H, D] tensor}."""
        self._bound(layer)
        start = time.perf_counter()
        objects = []
        for key, tensor in chunks.items():
            if self.dtype is not None and tensor.dtype != self.dtype:
                raise ValueError(f"chunk {key} layer {layer}: dtype {tensor.dtype}, store holds {self.dtype}")
            if self.kv_shape is not None and tuple(tensor.shape[2:]) != self.kv_shape:
                raise ValueError(f"chunk {key} layer {layer}: shape {list(tensor.shape)}, store holds "
                                 f"[2, n, {self.kv_shape[0]}, {self.kv_shape[1]}]")
            objects.append((key, *codec.encode(tensor, self.fingerprint, key=key, layer=layer)))
        self._guard(self._put, layer, objects)
        size = sum(len(h) + sum(v.nbytes for v in p) for _, h, p in objects)
        self._count(objects_written=len(objects), bytes_written=size, write_seconds=time.perf_counter() - start)

    def get_layer(self, layer: int, keys: Sequence[str], out: Sequence[torch.Tensor] | None = None
                  ) -> list[torch.Tensor]:
        """Read and validate layer `layer` of several chunks, in order. NotFound if any is missing.

        With `out` (one preallocated CPU tensor per key, of the expected dtype and
        [2, n_tokens, H, D] shape, each half contiguous), the bytes land in those tensors and
        they are returned: a connector reusing staging buffers pays no allocation or page
        faults per load."""
        return self.get_layers([layer], keys, None if out is None else [out])[0]

    def get_layer_into(self, layer: int, keys: Sequence[str], staging: torch.Tensor, chunk_lens: Sequence[int]) -> int:
        """Read layer `layer` of consecutive chunks into one reused contiguous CPU tensor [2, T, H, D]
        (T = sum(chunk_lens)), chunk j at its token slice; returns the payload bytes read.

        The decode hot path: each object is read straight into its slice of `staging` (files: readv)
        and checked there (header, key binding, xxh3) while it is still in cache; one byte view of
        the buffer serves every chunk, so no tensor is made per chunk. A chunk that holds another
        number of tokens than chunk_lens[j] is CorruptObject, a missing one NotFound."""
        keys = list(keys)
        self._bound(layer)
        if len(chunk_lens) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(chunk_lens)} chunk lengths")
        if staging.device.type != "cpu" or not staging.is_contiguous() or staging.dim() != 4 or \
                staging.shape[0] != 2 or staging.shape[1] != sum(chunk_lens):
            raise ValueError(f"staging must be a contiguous CPU tensor [2, {sum(chunk_lens)}, H, D], "
                             f"got {list(staging.shape)}")
        if self.dtype is not None and staging.dtype != self.dtype:
            raise ValueError(f"staging tensor of dtype {staging.dtype}, store holds {self.dtype}")
        if self.kv_shape is not None and tuple(staging.shape[2:]) != self.kv_shape:
            raise ValueError(f"staging shape {list(staging.shape)}, store holds [2, T, {self.kv_shape[0]}, "
                             f"{self.kv_shape[1]}]")
        start = time.perf_counter()
        whole = codec.tensor_bytes(staging)
        row = whole.nbytes // (2 * staging.shape[1]) if staging.shape[1] else 0
        half = whole.nbytes // 2
        spans, shapes, offset = [], [], 0
        heads, dim = staging.shape[2], staging.shape[3]
        for n in chunk_lens:
            a, b = offset * row, (offset + n) * row
            spans.append([whole[a:b], whole[half + a:half + b]])
            shapes.append((2, n, heads, dim))
            offset += n
        self._guard(self._get_spans, [(layer, key) for key in keys], spans, shapes, staging.dtype)
        self._count(objects_read=len(keys), bytes_read=codec.HEADER_SIZE * len(keys) + whole.nbytes,
                    read_seconds=time.perf_counter() - start)
        return whole.nbytes

    def get_layer_spans(self, layer: int, keys: Sequence[str], spans: SpanTable | Sequence[Sequence[memoryview]],
                        chunk_lens: Sequence[int], gate: WriteGate) -> int:
        """Read layer `layer` of consecutive chunks straight into memory the caller may take back (paged
        KV blocks); returns the payload bytes read.

        spans[j] are byte spans that chunk j's payload fills in order (its K rows, then its V rows,
        split anywhere: block pieces, scratch for rows not wanted), as memoryviews or as one
        kvstore.spans.SpanTable (what the compiled file reader takes), chunk_lens[j] its token count. Bytes
        reach the spans only inside `gate` (kvstore.gate): once the caller closed it, a read that
        returns late writes nothing there and the call raises LoadAbandoned. Each object is checked
        (header, key binding, xxh3) right after it landed; an error leaves the spans partly written
        (the caller recomputes over them). Needs a store opened with dtype and kv_shape."""
        keys = list(keys)
        self._bound(layer)
        if self.dtype is None or self.kv_shape is None:
            raise ValueError("get_layer_spans needs a store opened with dtype and kv_shape")
        if not len(spans) == len(chunk_lens) == len(keys):
            raise ValueError(f"{len(keys)} keys, {len(spans)} span lists and {len(chunk_lens)} chunk lengths")
        start = time.perf_counter()
        shapes = [(2, n, *self.kv_shape) for n in chunk_lens]
        items = [(layer, key) for key in keys]
        if isinstance(spans, SpanTable):
            self._guard(self._get_table, items, spans, shapes, self.dtype, gate)
        else:
            self._guard(self._get_spans, items, [list(row) for row in spans], shapes, self.dtype, gate)
        nbytes = 2 * sum(chunk_lens) * self.kv_shape[0] * self.kv_shape[1] * self.dtype.itemsize  # checked per object
        self._count(objects_read=len(keys), bytes_read=codec.HEADER_SIZE * len(keys) + nbytes,
                    read_seconds=time.perf_counter() - start)
        return nbytes

    def get_layers(self, layers: Sequence[int], keys: Sequence[str],
                   out: Sequence[Sequence[torch.Tensor]] | None = None) -> list[list[torch.Tensor]]:
        """Layers x chunks in one call: result[i][j] is layer layers[i] of chunk keys[j] (see the
        module docstring for `out` and the round trips)."""
        layers, keys = list(layers), list(keys)
        self._check_request(layers, keys, out)
        return self._read(layers, keys, out)

    def get_layers_async(self, layers: Sequence[int], keys: Sequence[str],
                         out: Sequence[Sequence[torch.Tensor]] | None = None) -> list[concurrent.futures.Future]:
        """get_layers in the background, one Future per layer (in `layers` order) resolving to that
        layer's tensors; bad arguments raise ValueError here, store errors come from the futures."""
        layers, keys = list(layers), list(keys)
        self._check_request(layers, keys, out)
        return [self.submit(self._read_layer, layer, keys, None if out is None else list(out[i]))
                for i, layer in enumerate(layers)]

    def _read_layer(self, layer: int, keys: list[str], out: list[torch.Tensor] | None) -> list[torch.Tensor]:
        return self._read([layer], keys, None if out is None else [out])[0]

    def _read(self, layers: list[int], keys: list[str], out: Sequence[Sequence[torch.Tensor]] | None
              ) -> list[list[torch.Tensor]]:
        """get_layers after its argument checks."""
        items = [(layer, key) for layer in layers for key in keys]
        start = time.perf_counter()
        if out is None:
            buffers = self._guard(self._get, items)
            flat = [self._guard(codec.decode, buf, self.fingerprint, self.dtype, self.kv_shape,
                                self.object_name(key, layer), key=key, layer=layer)
                    for (layer, key), buf in zip(items, buffers)]
        else:
            flat = [t for row in out for t in row]
            self._guard(self._get_into, items, flat)
        self._count(objects_read=len(items), bytes_read=sum(codec.HEADER_SIZE + t.nbytes for t in flat),
                    read_seconds=time.perf_counter() - start)
        return [flat[i * len(keys):(i + 1) * len(keys)] for i in range(len(layers))]

    def commit(self, keys: Sequence[str], num_layers: int | None = None) -> None:
        """Make chunks visible once all `num_layers` (default: the store's) layers are written.

        Chunks with a missing layer stay invisible and raise NotFound (after the complete
        ones were committed)."""
        self._bound()
        layers = num_layers if num_layers is not None else self.num_layers
        if not layers or layers < 1:
            raise ValueError("commit needs num_layers (open the store with num_layers or pass it)")
        self._guard(self._commit, list(keys), layers)
        self._count(chunks_committed=len(keys))

    def delete(self, keys: Sequence[str]) -> int:
        """Remove chunks (marker first, so they vanish atomically); returns how many existed."""
        self._bound()
        deleted = self._guard(self._delete, list(keys))
        self._count(chunks_deleted=deleted)
        return deleted

    # ---- background work ----
    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        """Run fn(*args) on the store's I/O pool (e.g. submit(store.lookup, keys))."""
        return self._pool.submit(fn, *args, **kwargs)

    def result(self, future: concurrent.futures.Future, timeout: float | None = None) -> Any:
        """future.result() with the store timeout (default) surfacing as StoreTimeout."""
        try:
            return future.result(timeout=self.timeout if timeout is None else timeout)
        except concurrent.futures.TimeoutError as exc:
            raise StoreTimeout(f"store operation took longer than {timeout or self.timeout:.1f}s") from exc

    def bounds_warning(self) -> str | None:
        """One line saying how this store can grow without limit, or None when it is bounded."""
        return None

    # ---- administration (all fingerprints) ----
    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(**vars(self._stats))

    def list_chunks(self, fingerprint: str | None = None) -> list[ChunkInfo]:
        """Every chunk (committed or not) of one or all fingerprints."""
        return self._guard(lambda: list(self._chunk_infos(fingerprint)))

    def inventory(self) -> dict[str, Usage]:
        """{fingerprint: Usage} over the whole backend."""
        usage: dict[str, Usage] = {}
        for info in self.list_chunks():
            u = usage.setdefault(info.fingerprint, Usage())
            u.chunks += info.committed
            u.objects += info.objects
            u.bytes += info.bytes
        return usage

    def verify(self, fingerprint: str | None = None) -> VerifyReport:
        """Re-check every object (header, fingerprint, key binding, checksum) of one or all fingerprints."""
        report = VerifyReport()
        objects = self._iter_objects(fingerprint)
        while (item := self._guard(next, objects, None)) is not None:
            fp, key, layer, name, buf = item
            report.objects += 1
            report.bytes += len(memoryview(buf).cast("B"))
            try:
                codec.decode(buf, fp, name=name, key=key, layer=layer)
            except CorruptObject as exc:
                report.corrupt.append(str(exc))
        return report

    def clear(self, fingerprint: str | None = None) -> int:
        """Delete every chunk of one or all fingerprints; returns the number of objects removed."""
        return self._guard(self._clear, fingerprint)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._close()

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def object_name(self, key: str, layer: int) -> str:
        """Human-readable object name for error messages."""
        return f"{self.fingerprint}/{key}/{layer}"

    # ---- helpers ----
    def _bound(self, layer: int | None = None) -> None:
        if self.fingerprint is None:
            raise ValueError("this store was opened without a model fingerprint (admin use only)")
        if layer is not None and (layer < 0 or (self.num_layers is not None and layer >= self.num_layers)):
            raise ValueError(f"layer {layer} out of range for a {self.num_layers}-layer store")

    def _check_request(self, layers: list[int], keys: list[str],
                       out: Sequence[Sequence[torch.Tensor]] | None) -> None:
        for layer in layers:
            self._bound(layer)
        self._bound()
        if out is None:
            return
        if len(out) != len(layers):
            raise ValueError(f"{len(layers)} layers but {len(out)} rows of output tensors")
        for row in out:
            if len(row) != len(keys):
                raise ValueError(f"{len(keys)} keys but {len(row)} output tensors")
            for tensor in row:
                if self.dtype is not None and tensor.dtype != self.dtype:
                    raise ValueError(f"output tensor of dtype {tensor.dtype}, store holds {self.dtype}")
                codec.payload_views(tensor)  # ValueError unless a CPU tensor with contiguous K and V halves

    def _guard(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call a backend hook; count failures and make sure only StoreError subclasses escape."""
        try:
            return fn(*args, **kwargs)
        except StoreError:
            self._count(errors=1)
            raise
        except self._io_errors as exc:
            self._count(errors=1)
            raise self._translate(exc) from exc

    # ---- backend hooks ----
    _io_errors: tuple[type[Exception], ...] = (OSError,)  # the backend's own exceptions, see _translate

    @abstractmethod
    def _translate(self, exc: Exception) -> StoreError:
        """Map one of the backend's own exceptions to a typed store error."""

    def _count(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + delta)

    @abstractmethod
    def _lookup(self, keys: list[str]) -> int: ...

    @abstractmethod
    def _put(self, layer: int, objects: list[tuple[str, bytes, list[memoryview]]]) -> None:
        """Store (key, header, payload spans) objects of one layer; each object appears atomically."""

    @abstractmethod
    def _get(self, items: list[tuple[int, str]]) -> list[Buffer]:
        """Raw object bytes of (layer, key) items, in order; NotFound for a missing one."""

    def _get_into(self, items: list[tuple[int, str]], out: list[torch.Tensor]) -> None:
        """Fill preallocated tensors (each K and V half contiguous)."""
        self._get_spans(items, [codec.payload_views(t) for t in out], [tuple(t.shape) for t in out],
                        out[0].dtype if out else torch.uint8)

    def _get_spans(self, items: list[tuple[int, str]], spans: list[list[memoryview]], shapes: list[tuple[int, ...]],
                   dtype: torch.dtype, gate: WriteGate = NO_GATE) -> None:
        """Read each (layer, key) object's payload into its spans (its K bytes, then its V bytes, in any
        number of pieces), writing them only inside `gate`, and check it against `dtype` and its shape;
        backends that can read straight into the spans override this."""
        for (layer, key), buf, payload, shape in zip(items, self._get(items), spans, shapes):
            name = self.object_name(key, layer)
            view = memoryview(buf).cast("B")
            codec.check_size(name, view.nbytes, payload, shape, dtype)
            with gate.writing():  # the object is in our memory already: a bounded copy
                copy_into(view[codec.HEADER_SIZE:], payload)
            codec.check_payload(view[:codec.HEADER_SIZE], payload, self.fingerprint, dtype, shape, name, key=key,
                                layer=layer)

    def _get_table(self, items: list[tuple[int, str]], table: SpanTable, shapes: list[tuple[int, ...]],
                   dtype: torch.dtype, gate: WriteGate) -> None:
        """_get_spans into a SpanTable's spans; backends with a reader that takes the table override this."""
        self._get_spans(items, table.views(), shapes, dtype, gate)

    @abstractmethod
    def _commit(self, keys: list[str], num_layers: int) -> None: ...

    @abstractmethod
    def _delete(self, keys: list[str]) -> int: ...

    @abstractmethod
    def _chunk_infos(self, fingerprint: str | None) -> Iterator[ChunkInfo]: ...

    @abstractmethod
    def _iter_objects(self, fingerprint: str | None) -> Iterator[tuple[str, str, int, str, Buffer]]:
        """(fingerprint, chunk key, layer, object name, raw bytes) of every stored layer object
        (key and layer as its name says: verify checks the object's binding against them)."""

    @abstractmethod
    def _clear(self, fingerprint: str | None) -> int: ...

    def _close(self) -> None:
        """Release backend resources."""
