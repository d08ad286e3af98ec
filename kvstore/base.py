"""The KV store interface that connectors build on: small, batched, typed errors.

Data model. A prompt is cut into chunks of C tokens (common.hashing.chunk_keys gives their
keys; the last chunk may be partial). Each chunk is stored as one object per layer, holding
a tensor [2, n_tokens, num_kv_heads, head_dim] (K and V) in the codec format (kvstore.object_format),
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
no ttl and no maxmemory, or a policy that never evicts our keys, or a file store opened with
max_bytes=0), else None; `bounds_note()` says which bound a store got (a file store's default:
kvstore/fs_space.py). Nodes log both at start-up.

Parallel layouts and codecs: put_layer(layer, chunks, heads=(lo, hi)) writes a TP rank's KV heads only,
commit(keys, layout=..., part=i) commits one part of a multi-rank writer (kvstore/layout.py), and
layouts(keys) says what each committed chunk's writer saved (its head groups, its codec); the read
calls take heads= too, and get_layer_decoded reads objects of any codec (kvstore/payload_codecs.py; a store
writes with the `codec` it was opened with). A store opened with heads_per_object=K writes each layer of a
head group as objects of at most K heads, and its commits record that grain (kvstore/layout.py).

Administration (any fingerprint, used by the `pd-kvstore` CLI; kvstore/admin.py): inventory(), list_chunks(),
verify(), clear(). stats() returns this process's counters.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from abc import abstractmethod
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from pdserve.kvstore import object_format, payload_codecs
from pdserve.kvstore.admin import StoreAdmin
from pdserve.kvstore.errors import StoreError, StoreTimeout
from pdserve.kvstore.layout import Heads, WriterLayout, object_layer, split_heads
from pdserve.kvstore.coded_reads import CodedReads
from pdserve.kvstore.reads import LayerReads
from pdserve.kvstore.records import Buffer, StoreStats


class KVStore(LayerReads, CodedReads, StoreAdmin):
    """A chunked, per-layer KV store bound to one model fingerprint (see the module docstring): the
    write path, commits and deletes, the I/O pool and the backend hooks here; reads in
    kvstore/reads.py, administration in kvstore/admin.py, result types in kvstore/records.py."""

    def __init__(self, fingerprint: str | None = None, num_layers: int | None = None,
                 dtype: torch.dtype | str | None = None, kv_shape: Sequence[int] | None = None,
                 timeout: float = 5.0, io_threads: int = 4, codec: str = payload_codecs.RAW,
                 heads_per_object: int = 0) -> None:
        if fingerprint is not None:
            object_format.fingerprint_bytes(fingerprint)
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self.fingerprint = fingerprint
        self.num_layers = num_layers
        self.dtype = object_format.as_dtype(dtype) if dtype is not None else None
        self.kv_shape = tuple(kv_shape) if kv_shape is not None else None
        self.timeout = float(timeout)
        self.codec = payload_codecs.check_name(codec)  # what this store's writes encode with (reads: any)
        if isinstance(heads_per_object, bool) or not isinstance(heads_per_object, int) or heads_per_object < 0:
            raise ValueError(f"heads_per_object must be an integer >= 0, got {heads_per_object!r}")
        self.heads_per_object = heads_per_object  # what this store's writes split head groups by (0: not at all)
        self._stats = StoreStats()
        self._lock = threading.Lock()
        self.io_threads = io_threads  # the I/O pool's threads: how many reads may run at once
        self._layout_cache: dict[str, WriterLayout] = {}  # chunk key -> its marker's layout (lookups fill it)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="kvstore-io")

    # ---- data path (needs a fingerprint) ----
    def lookup(self, keys: Sequence[str]) -> int:
        """Number of leading chunks of `keys` that are committed (the longest present prefix)."""
        self._bound()
        hits = self._guard(self._lookup, list(keys))
        self._count(lookups=1, lookup_chunks=len(keys), hit_chunks=hits)
        return hits

    def put_layer(self, layer: int, chunks: Mapping[str, torch.Tensor], heads: Heads | None = None) -> None:
        """Write layer `layer` of several chunks: {chunk key: [2, n_tokens, H, D] tensor}; with `heads`
        (lo, hi), the tensors hold KV heads [lo, hi) only: a TP rank's part (kvstore/layout.py). With the
        store's heads_per_object K, each chunk's heads go into objects of at most K heads (split_heads)."""
        self._bound(layer)
        name, kv_shape = self._part(layer, heads)
        for key, tensor in chunks.items():
            if self.dtype is not None and tensor.dtype != self.dtype:
                raise ValueError(f"chunk {key} layer {layer}: dtype {tensor.dtype}, store holds {self.dtype}")
            if kv_shape is not None and tuple(tensor.shape[2:]) != kv_shape:
                raise ValueError(f"chunk {key} layer {layer}: shape {list(tensor.shape)}, store holds "
                                 f"[2, n, {kv_shape[0]}, {kv_shape[1]}]")
        start = time.perf_counter()
        pieces = [(name, None)]
        if self.heads_per_object:
            if self.kv_shape is None:
                raise ValueError("heads_per_object needs a store opened with kv_shape")
            group = heads or (0, self.kv_shape[0])
            split = split_heads(group, self.heads_per_object)
            if len(split) > 1:  # one object per run of heads: slices of the tensors (heads relative to the group)
                pieces = [(object_layer(layer, (a, b), self.kv_shape[0]), (a - group[0], b - group[0]))
                          for a, b in split]
        written = 0
        for piece, cut in pieces:
            objects = [(key, *object_format.encode(tensor if cut is None else _heads_of(tensor, *cut), self.fingerprint,
                                           key=key, layer=piece, codec=self.codec)) for key, tensor in chunks.items()]
            self._guard(self._put, piece, objects)
            written += sum(len(h) + sum(v.nbytes for v in p) for _, h, p in objects)
        self._count(objects_written=len(chunks) * len(pieces), bytes_written=written,
                    write_seconds=time.perf_counter() - start)

    def commit(self, keys: Sequence[str], num_layers: int | None = None, *, layout: WriterLayout | None = None,
               part: int = 0) -> None:
        """Make chunks visible once all `num_layers` (default: the store's) layers are written.

        With a multi-part `layout` (kvstore/layout.py), commit part `part` of it (its objects must all
        be written): the chunk becomes visible when the last of its parts is committed, by whichever
        writer commits that part. Chunks with a missing object stay invisible and raise NotFound
        (after the complete ones were committed)."""
        self._bound()
        layers = num_layers if num_layers is not None else self.num_layers
        if layout is None:
            if not layers or layers < 1:
                raise ValueError("commit needs num_layers (open the store with num_layers or pass it)")
            layout = WriterLayout(layers)
        if not layout.single and self.kv_shape is None:
            raise ValueError("a multi-part commit needs a store opened with kv_shape")
        if not 0 <= part < layout.num_parts():
            raise ValueError(f"part {part} of a {layout.num_parts()}-part layout")
        layout = dataclasses.replace(layout, codec=self.codec)  # readers learn the codec before they read
        if self.heads_per_object:  # and the objects put_layer split the heads into
            if self.kv_shape is None:
                raise ValueError("heads_per_object needs a store opened with kv_shape")
            split = dataclasses.replace(layout, num_kv_heads=layout.num_kv_heads or self.kv_shape[0],
                                        object_heads=self.heads_per_object)
            layout = split if split.object_heads else layout  # splitting nothing: the marker of before
        self._guard(self._commit, list(keys), layout, part)
        self._count(chunks_committed=len(keys))

    def layouts(self, keys: Sequence[str]) -> list[WriterLayout]:
        """The writer layout of each committed chunk (what its commit marker records; NotFound for a chunk
        that is not committed). Answered from the last lookup's markers where it read them."""
        self._bound()
        keys = list(keys)
        cache = self._layout_cache
        found = [cache.get(key) for key in keys]
        missing = [key for key, layout in zip(keys, found) if layout is None]
        if missing:
            read = dict(zip(missing, self._guard(self._read_layouts, missing)))
            found = [layout or read[key] for key, layout in zip(keys, found)]
        return found

    def cached_layouts(self, keys: Sequence[str]) -> list[WriterLayout] | None:
        """The chunks' layouts when this process's lookups read all of them (no I/O), else None."""
        cache = self._layout_cache
        found = [cache.get(key) for key in keys]
        return None if any(layout is None for layout in found) else found

    def _remember_layouts(self, pairs: Sequence[tuple[str, WriterLayout]]) -> None:
        """Keep the layouts a lookup read for the load that usually follows it (recent chunks only)."""
        if len(self._layout_cache) > 8192:
            self._layout_cache.clear()
        self._layout_cache.update(pairs)

    def _part(self, layer: int, heads: Heads | None) -> tuple[int | str, tuple[int, ...] | None]:
        """(object layer name, its [H, D]) of layer `layer`'s object holding KV heads `heads` (None: all)."""
        if heads is None:
            return layer, self.kv_shape
        if self.kv_shape is None or not 0 <= heads[0] < heads[1] <= self.kv_shape[0]:
            raise ValueError(f"KV heads {heads} of a store holding {self.kv_shape}")
        return object_layer(layer, heads, self.kv_shape[0]), (heads[1] - heads[0], self.kv_shape[1])

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

    def bounds_note(self) -> str | None:
        """One line saying how this store is bounded, where the store chose the bound itself."""
        return None

    # ---- lifetime ----
    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._close()

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def object_name(self, key: str, layer: int | str) -> str:
        """Human-readable object name for error messages."""
        return f"{self.fingerprint}/{key}/{layer}"

    # ---- helpers ----
    def _bound(self, layer: int | None = None) -> None:
        if self.fingerprint is None:
            raise ValueError("this store was opened without a model fingerprint (admin use only)")
        if layer is not None and (layer < 0 or (self.num_layers is not None and layer >= self.num_layers)):
            raise ValueError(f"layer {layer} out of range for a {self.num_layers}-layer store")

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
    def _put(self, layer: int | str, objects: list[tuple[str, bytes, list[memoryview]]]) -> None:
        """Store (key, header, payload spans) objects of one layer; each object appears atomically."""

    @abstractmethod
    def _get(self, items: list[tuple[int | str, str]]) -> list[Buffer]:
        """Raw object bytes of (layer name, key) items, in order; NotFound for a missing one."""

    @abstractmethod
    def _commit(self, keys: list[str], layout: WriterLayout, part: int) -> None:
        """Commit part `part` of `layout` of each chunk (the single layout: the whole chunk)."""

    @abstractmethod
    def _read_layouts(self, keys: list[str]) -> list[WriterLayout]:
        """The layouts the chunks' commit markers record; NotFound for one not committed."""

    @abstractmethod
    def _delete(self, keys: list[str]) -> int: ...

    def _close(self) -> None:
        """Release backend resources."""


def _heads_of(tensor: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """KV heads [lo, hi) of a [2, n, H, D] CPU tensor, contiguous: copied in numpy, single-threaded (puts run on
    the store's I/O threads, which never start an OpenMP team of their own: docs/architecture.md)."""
    part = tensor.detach().cpu()[:, :, lo:hi]
    out = torch.empty(part.shape, dtype=part.dtype)
    np.copyto(out.view(torch.uint8).numpy(), part.view(torch.uint8).numpy())
    return out
