"""The KV store interface that connectors build on: small, batched, typed errors.

Data model. A prompt is cut into chunks of C tokens (kvstore.keys.chunk_keys gives their
keys; the last chunk may be partial). Each chunk is stored as one object per layer, holding
a tensor [2, n_tokens, num_kv_heads, head_dim] (K and V) in the codec format (kvstore.codec),
plus a commit marker written after all of its layers. A chunk is *present* only once its
marker exists, so readers never see a chunk whose layers are incomplete.

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

Overlapping I/O with compute: `put_layer_async` / `get_layer_async` (or `submit(fn, ...)`
for anything else) run on the store's thread pool and return concurrent.futures.Future;
`result(future, timeout)` waits and turns a timeout into StoreTimeout. Wait for every
put of a chunk before committing it. All methods are thread-safe.

Errors (kvstore.errors): StoreUnavailable (backend unreachable), StoreTimeout, CorruptObject
(any validation failure, never garbage data), NotFound (object missing: evicted, expired or
never written). Every one means "recompute" to a caller. Redis calls are bounded by socket
timeouts; filesystem calls are plain syscalls, so bound a possibly hung NFS mount by
waiting on the async variant with a timeout.

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

from kvstore import codec
from kvstore.errors import CorruptObject, StoreError, StoreTimeout

Buffer = bytes | bytearray | memoryview


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
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="kvstore-io")

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
            objects.append((key, *codec.encode(tensor, self.fingerprint)))
        self._guard(self._put, layer, objects)
        size = sum(len(h) + p.nbytes for _, h, p in objects)
        self._count(objects_written=len(objects), bytes_written=size, write_seconds=time.perf_counter() - start)

    def get_layer(self, layer: int, keys: Sequence[str], out: Sequence[torch.Tensor] | None = None
                  ) -> list[torch.Tensor]:
        """Read and validate layer `layer` of several chunks, in order. NotFound if any is missing.

        With `out` (one preallocated contiguous CPU tensor per key, of the expected dtype and
        [2, n_tokens, H, D] shape), the bytes land in those tensors and they are returned: a
        connector reusing staging buffers pays no allocation or page faults per load."""
        self._bound(layer)
        keys = list(keys)
        start = time.perf_counter()
        if out is None:
            buffers = self._guard(self._get, layer, keys)
            tensors = [self._guard(codec.decode, buf, self.fingerprint, self.dtype, self.kv_shape,
                                   self.object_name(key, layer)) for key, buf in zip(keys, buffers)]
        else:
            if len(out) != len(keys):
                raise ValueError(f"{len(keys)} keys but {len(out)} output tensors")
            tensors = list(out)
            self._guard(self._get_into, layer, keys, tensors)
        self._count(objects_read=len(keys), bytes_read=sum(codec.HEADER_SIZE + t.nbytes for t in tensors),
                    read_seconds=time.perf_counter() - start)
        return tensors

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

    # ---- background variants ----
    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        """Run fn(*args) on the store's I/O pool (e.g. submit(store.lookup, keys))."""
        return self._pool.submit(fn, *args, **kwargs)

    def put_layer_async(self, layer: int, chunks: Mapping[str, torch.Tensor]) -> concurrent.futures.Future:
        """put_layer in the background; leave the tensors untouched until the future is done."""
        return self.submit(self.put_layer, layer, dict(chunks))

    def get_layer_async(self, layer: int, keys: Sequence[str], out: Sequence[torch.Tensor] | None = None
                        ) -> concurrent.futures.Future:
        """get_layer in the background; the future's result is the list of tensors."""
        return self.submit(self.get_layer, layer, list(keys), None if out is None else list(out))

    def result(self, future: concurrent.futures.Future, timeout: float | None = None) -> Any:
        """future.result() with the store timeout (default) surfacing as StoreTimeout."""
        try:
            return future.result(timeout=self.timeout if timeout is None else timeout)
        except concurrent.futures.TimeoutError as exc:
            raise StoreTimeout(f"store operation took longer than {timeout or self.timeout:.1f}s") from exc

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
        """Re-check every object (checksum, header, fingerprint) of one or all fingerprints."""
        report = VerifyReport()
        objects = self._iter_objects(fingerprint)
        while (item := self._guard(next, objects, None)) is not None:
            fp, name, buf = item
            report.objects += 1
            report.bytes += len(memoryview(buf).cast("B"))
            try:
                codec.decode(buf, fp, name=name)
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

    def _guard(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Call a backend hook; count failures and make sure only StoreError subclasses escape."""
        try:
            return fn(*args)
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
    def _put(self, layer: int, objects: list[tuple[str, bytes, memoryview]]) -> None:
        """Store (key, header, payload) objects of one layer; each object appears atomically."""

    @abstractmethod
    def _get(self, layer: int, keys: list[str]) -> list[Buffer]:
        """Raw object bytes in key order; NotFound for a missing one."""

    def _get_into(self, layer: int, keys: list[str], out: list[torch.Tensor]) -> None:
        """Fill preallocated tensors; backends that can read straight into them override this."""
        for key, buf, tensor in zip(keys, self._get(layer, keys), out):
            name = self.object_name(key, layer)
            view = memoryview(buf).cast("B")
            target = codec.tensor_bytes(tensor)
            if view.nbytes != codec.HEADER_SIZE + target.nbytes:
                raise CorruptObject(f"{name}: {view.nbytes} bytes, expected {codec.HEADER_SIZE} + {target.nbytes} "
                                    f"for {list(tensor.shape)} {tensor.dtype}")
            target[:] = view[codec.HEADER_SIZE:]
            codec.decode_into(view[:codec.HEADER_SIZE], tensor, target, self.fingerprint, name)

    @abstractmethod
    def _commit(self, keys: list[str], num_layers: int) -> None: ...

    @abstractmethod
    def _delete(self, keys: list[str]) -> int: ...

    @abstractmethod
    def _chunk_infos(self, fingerprint: str | None) -> Iterator[ChunkInfo]: ...

    @abstractmethod
    def _iter_objects(self, fingerprint: str | None) -> Iterator[tuple[str, str, Buffer]]:
        """(fingerprint, object name, raw bytes) of every stored layer object."""

    @abstractmethod
    def _clear(self, fingerprint: str | None) -> int: ...

    def _close(self) -> None:
        """Release backend resources."""
