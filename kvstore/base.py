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

Batched loads (the decode hot path: all chunks of a prompt, many layers, one call): get_layers and
get_layers_async, kvstore/reads.py says how.

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
kvstore/fs_space.py). Nodes log both at start-up. `capacity_warning(chunk_tokens, prompt_tokens)` says
when a bound is too small for the node's chunks (a ValueError when it cannot keep even one).

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
import time
from abc import ABC, abstractmethod
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from pdserve.kvstore import object_format, payload_codecs
from pdserve.kvstore.admin import StoreAdmin
from pdserve.kvstore.binding import ModelBinding
from pdserve.kvstore.calls import StoreCalls
from pdserve.kvstore.coded_reads import CodedReader
from pdserve.kvstore.errors import StoreError, StoreTimeout
from pdserve.kvstore.gate import NO_GATE, WriteGate
from pdserve.kvstore.layout import Heads, LayoutCache, WriterLayout, object_layer, split_heads
from pdserve.kvstore.native_reader import ReaderSlot
from pdserve.kvstore.reads import LayerReader, copy_into_spans
from pdserve.kvstore.records import Buffer, ChunkInfo, StoreStats, Usage, VerifyReport
from pdserve.kvstore.spans import SpanReader, SpanTable


class KVStore(ABC):
    """A chunked, per-layer KV store bound to one model fingerprint (see the module docstring): the write
    path, commits and deletes, the I/O pool and the backend hooks here. It holds the model it is bound to
    (`_model`, kvstore/binding.py), its guarded and counted backend calls (`_calls`, kvstore/calls.py) and
    the members that serve the rest through the backend hooks: layer reads (`_reads`, kvstore/reads.py),
    coded reads (`_coded`, kvstore/coded_reads.py) and administration (`_admin`, kvstore/admin.py)."""

    _io_errors: tuple[type[Exception], ...] = (OSError,)  # the backend's own exceptions, see _translate

    def __init__(self, fingerprint: str | None = None, num_layers: int | None = None,
                 dtype: torch.dtype | str | None = None, kv_shape: Sequence[int] | None = None,
                 timeout: float = 5.0, io_threads: int = 4, codec: str = payload_codecs.RAW,
                 heads_per_object: int = 0) -> None:
        if fingerprint is not None:
            object_format.fingerprint_bytes(fingerprint)
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self._model = ModelBinding(fingerprint, num_layers, object_format.as_dtype(dtype) if dtype is not None else None,
                                   tuple(kv_shape) if kv_shape is not None else None)
        self.timeout = float(timeout)
        self.codec = payload_codecs.check_name(codec)  # what this store's writes encode with (reads: any)
        if isinstance(heads_per_object, bool) or not isinstance(heads_per_object, int) or heads_per_object < 0:
            raise ValueError(f"heads_per_object must be an integer >= 0, got {heads_per_object!r}")
        self.heads_per_object = heads_per_object  # what this store's writes split head groups by (0: not at all)
        self.io_threads = io_threads  # the I/O pool's threads: how many reads may run at once
        self._layouts = LayoutCache()  # the markers' layouts that lookups read, for the loads that follow
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="kvstore-io")
        self._calls = StoreCalls(self._io_errors, self._translate)
        self._span_readers = ReaderSlot()
        self._reads = LayerReader(self._model, self, self._calls, self.submit)
        self._coded = CodedReader(self._model, self, self._calls)
        self._admin = StoreAdmin(self._model, self, self._calls)

    # ---- the model this store is bound to (kvstore/binding.py) ----
    @property
    def fingerprint(self) -> str | None:
        return self._model.fingerprint

    @property
    def num_layers(self) -> int | None:
        return self._model.num_layers

    @property
    def dtype(self) -> torch.dtype | None:
        return self._model.dtype

    @property
    def kv_shape(self) -> tuple[int, ...] | None:
        return self._model.kv_shape

    @property
    def span_reader(self) -> SpanReader | None:
        """The compiled reader of loads into spans (kvstore/native_reader.py, ReaderSlot); None: the Python paths."""
        return self._span_readers.get()

    @span_reader.setter
    def span_reader(self, reader: SpanReader | None) -> None:
        self._span_readers.set(reader)

    # ---- data path (needs a fingerprint) ----
    def lookup(self, keys: Sequence[str]) -> int:
        """Number of leading chunks of `keys` that are committed (the longest present prefix)."""
        self._model.check()
        found = self._calls.guard(self._lookup, list(keys))
        self._layouts.remember([(key, layout) for key, layout in found if layout is not None])
        self._calls.count(lookups=1, lookup_chunks=len(keys), hit_chunks=len(found))
        return len(found)

    def put_layer(self, layer: int, chunks: Mapping[str, torch.Tensor], heads: Heads | None = None) -> None:
        """Write layer `layer` of several chunks: {chunk key: [2, n_tokens, H, D] tensor}; with `heads`
        (lo, hi), the tensors hold KV heads [lo, hi) only: a TP rank's part (kvstore/layout.py). With the
        store's heads_per_object K, each chunk's heads go into objects of at most K heads (split_heads)."""
        self._model.check(layer)
        name, kv_shape = self._model.part(layer, heads)
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
            objects = [(key, *object_format.encode(tensor if cut is None else object_format.heads_of(tensor, *cut),
                                                   self.fingerprint, key=key, layer=piece, codec=self.codec))
                       for key, tensor in chunks.items()]
            self._calls.guard(self._put, piece, objects)
            written += sum(len(h) + sum(v.nbytes for v in p) for _, h, p in objects)
        self._calls.count(objects_written=len(chunks) * len(pieces), bytes_written=written,
                          write_seconds=time.perf_counter() - start)

    def commit(self, keys: Sequence[str], num_layers: int | None = None, *, layout: WriterLayout | None = None,
               part: int = 0) -> None:
        """Make chunks visible once all `num_layers` (default: the store's) layers are written.

        With a multi-part `layout` (kvstore/layout.py), commit part `part` of it (its objects must all
        be written): the chunk becomes visible when the last of its parts is committed, by whichever
        writer commits that part. Chunks with a missing object stay invisible and raise NotFound
        (after the complete ones were committed)."""
        self._model.check()
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
        self._calls.guard(self._commit, list(keys), layout, part)
        self._calls.count(chunks_committed=len(keys))

    def layouts(self, keys: Sequence[str]) -> list[WriterLayout]:
        """The writer layout of each committed chunk (what its commit marker records; NotFound for a chunk
        that is not committed). Answered from the last lookup's markers where it read them."""
        self._model.check()
        keys = list(keys)
        found = self._layouts.get(keys)
        missing = [key for key, layout in zip(keys, found) if layout is None]
        if missing:
            read = dict(zip(missing, self._calls.guard(self._read_layouts, missing)))
            found = [layout or read[key] for key, layout in zip(keys, found)]
        return found

    def cached_layouts(self, keys: Sequence[str]) -> list[WriterLayout] | None:
        """The chunks' layouts when this process's lookups read all of them (no I/O), else None."""
        found = self._layouts.get(keys)
        return None if any(layout is None for layout in found) else found

    # ---- reads (kvstore/reads.py, kvstore/coded_reads.py: what each takes and returns) ----
    def get_layer(self, layer: int, keys: Sequence[str], out: Sequence[torch.Tensor] | None = None,
                  heads: Heads | None = None) -> list[torch.Tensor]:
        return self._reads.get_layer(layer, keys, out, heads)

    def get_layer_into(self, layer: int, keys: Sequence[str], staging: torch.Tensor, chunk_lens: Sequence[int],
                       heads: Heads | None = None) -> int:
        return self._reads.get_layer_into(layer, keys, staging, chunk_lens, heads)

    def get_layer_spans(self, layer: int, keys: Sequence[str], spans: SpanTable | Sequence[Sequence[memoryview]],
                        chunk_lens: Sequence[int], gate: WriteGate, heads: Heads | None = None) -> int:
        return self._reads.get_layer_spans(layer, keys, spans, chunk_lens, gate, heads)

    def get_layers(self, layers: Sequence[int], keys: Sequence[str],
                   out: Sequence[Sequence[torch.Tensor]] | None = None, heads: Heads | None = None
                   ) -> list[list[torch.Tensor]]:
        return self._reads.get_layers(layers, keys, out, heads)

    def get_layers_async(self, layers: Sequence[int], keys: Sequence[str],
                         out: Sequence[Sequence[torch.Tensor]] | None = None) -> list[concurrent.futures.Future]:
        return self._reads.get_layers_async(layers, keys, out)

    def get_layer_decoded(self, layer: int, keys: Sequence[str], heads: Heads | None = None
                          ) -> tuple[list[torch.Tensor], int, set[str]]:
        return self._reads.get_layer_decoded(layer, keys, heads)

    def get_layer_coded(self, layer: int, keys: Sequence[str], spans: SpanTable, chunk_lens: Sequence[int],
                        gate: WriteGate, heads: Heads | None = None,
                        codecs: Sequence[str] | None = None) -> tuple[int, set[str]]:
        return self._coded.get_layer_coded(layer, keys, spans, chunk_lens, gate, heads, codecs)

    # ---- administration (kvstore/admin.py) ----
    def stats(self) -> StoreStats:
        """This process's counters."""
        return self._calls.stats()

    def list_chunks(self, fingerprint: str | None = None) -> list[ChunkInfo]:
        return self._admin.list_chunks(fingerprint)

    def inventory(self) -> dict[str, Usage]:
        return self._admin.inventory()

    def verify(self, fingerprint: str | None = None, repair: bool = False) -> VerifyReport:
        return self._admin.verify(fingerprint, repair)

    def repair(self, keys: Sequence[str]) -> int:
        return self._admin.repair(keys)

    def clear(self, fingerprint: str | None = None) -> int:
        return self._admin.clear(fingerprint)

    def delete(self, keys: Sequence[str]) -> int:
        """Remove chunks (marker first, so they vanish atomically); returns how many existed."""
        self._model.check()
        deleted = self._calls.guard(self._delete, list(keys))
        self._calls.count(chunks_deleted=deleted)
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

    def capacity_warning(self, chunk_tokens: int, prompt_tokens: int) -> str | None:
        """For a store opened for a model, whose node saves chunks of `chunk_tokens` tokens of prompts up to
        `prompt_tokens`: one line (what to set) when its bound keeps too few of them for a decode to find them,
        ValueError when it cannot keep one chunk at all (the connector calls it when it opens the store)."""
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

    # ---- backend hooks ----
    @abstractmethod
    def _translate(self, exc: Exception) -> StoreError:
        """Map one of the backend's own exceptions (`_io_errors`) to a typed store error."""

    @abstractmethod
    def _lookup(self, keys: list[str]) -> list[tuple[str, WriterLayout | None]]:
        """The leading committed chunks of `keys`, each with the layout its marker records (None: unreadable;
        the load fails, and repair heals it)."""

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

    # administration's hooks (kvstore/admin.py, ChunkInventory, says what each returns)
    @abstractmethod
    def _chunk_infos(self, fingerprint: str | None) -> Iterator[ChunkInfo]: ...

    @abstractmethod
    def _iter_objects(self, fingerprint: str | None) -> Iterator[tuple[str, str, int | str, str, Buffer]]: ...

    @abstractmethod
    def _clear(self, fingerprint: str | None) -> int: ...

    @abstractmethod
    def _committed_chunks(self, fingerprint: str | None) -> Iterator[tuple[str, str]]: ...

    @abstractmethod
    def _damage(self, fingerprint: str, key: str) -> tuple[str | None, list[int | str]]: ...

    @abstractmethod
    def _uncommit(self, fingerprint: str, key: str) -> bool: ...

    def _close(self) -> None:
        """Release backend resources."""

    # reads into caller memory: defaults for a backend that can only read whole objects
    def _get_spans(self, items: list[tuple[int | str, str]], spans: list[list[memoryview]],
                   shapes: list[tuple[int, ...]], dtype: torch.dtype, gate: WriteGate = NO_GATE) -> None:
        """Read each (layer, key) object's payload into its spans, writing them only inside `gate`, and check it;
        backends that read straight into the spans override this (this one copies whole objects in)."""
        copy_into_spans(self, self.fingerprint, items, spans, shapes, dtype, gate)

    def _get_table(self, items: list[tuple[int | str, str]], table: SpanTable, shapes: list[tuple[int, ...]],
                   dtype: torch.dtype, gate: WriteGate) -> None:
        """_get_spans into a SpanTable's spans; backends with a reader that takes the table override this."""
        self._get_spans(items, table.views(), shapes, dtype, gate)

    def _get_whole(self, items: list[tuple[int | str, str]], sizes: list[int], expect: bytes
                   ) -> tuple[list[memoryview], memoryview, list[int]] | None:
        """Objects whose payloads are `sizes` bytes (and whose header bytes [0, SUMMED) should be `expect`'s, back
        to back) read whole by a compiled reader: (payloads, their headers back to back, xxh3 digests of header
        bytes [0, SUMMED) and payload). None: no such reader here, or an object that is not plainly what is
        expected (kvstore/coded_reads.py then reads the layer again, checking each object)."""
        return None

