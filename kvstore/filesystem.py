"""file:///path backend: one directory tree shared by every node (local disk or NFS).

Layout: <root>/<fingerprint>/<key[:2]>/<key>/<layer>.kv plus <key>/commit, the marker that
makes the chunk visible. Every file is written to a hidden temp file in the same directory
and renamed into place, so readers see whole objects only and concurrent writers of the
same chunk simply replace each other's identical bytes. Removal renames the chunk
directory away first (one atomic step), then deletes it.

max_bytes bounds the bytes of layer objects under <root> (all fingerprints): every commit
scans the committed chunks (one stat per chunk) and evicts whole chunks, least recently
used first. The LRU clock is the marker's mtime, set at commit and refreshed whenever a
reader loads layer 0, so it works across processes and machines with no index to keep.
"""
from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import struct
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import torch

from kvstore import codec
from kvstore.base import Buffer, ChunkInfo, KVStore
from kvstore.errors import CorruptObject, NotFound, StoreError, StoreTimeout, StoreUnavailable

logger = logging.getLogger(__name__)

MARKER = "commit"
_MARKER = struct.Struct("<4sHIQ")  # magic, version, num_layers, bytes of the chunk's layer objects
_MARKER_MAGIC = b"PDKC"
_KEY = re.compile(r"[0-9A-Za-z_-]{3,128}")
_FP = re.compile(r"[0-9a-f]{32}")
ORPHAN_GRACE_S = 600.0  # an uncommitted chunk untouched this long was left by a dead writer


class FileSystemStore(KVStore):
    def __init__(self, root: str | os.PathLike, *, max_bytes: int | None = None, fsync: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.root = Path(root)
        self._root = str(self.root)
        self.max_bytes = max_bytes
        self.fsync = fsync
        self._sizes: dict[str, int] = {}  # marker path -> chunk bytes (immutable once committed)
        self._evict_lock = threading.Lock()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreUnavailable(f"cannot use {self.root} as a KV store: {exc.strerror}") from exc
        if not os.access(self.root, os.R_OK | os.W_OK | os.X_OK):
            raise StoreUnavailable(f"cannot use {self.root} as a KV store: permission denied")

    # ---- paths ----
    def _chunk_dir(self, key: str, fingerprint: str | None = None) -> str:
        if not _KEY.fullmatch(key):
            raise ValueError(f"invalid chunk key {key!r}")
        return f"{self._root}/{fingerprint or self.fingerprint}/{key[:2]}/{key}"  # f-string: hot path

    def object_name(self, key: str, layer: int) -> str:
        return f"{self._chunk_dir(key)}/{layer}.kv"

    # ---- hooks ----
    def _translate(self, exc: Exception) -> StoreError:
        if isinstance(exc, FileNotFoundError):
            return NotFound(f"{exc.filename}: no such object")
        if isinstance(exc, TimeoutError) or getattr(exc, "errno", None) == errno.ETIMEDOUT:
            return StoreTimeout(f"{getattr(exc, 'filename', '')}: {exc}")
        return StoreUnavailable(f"{getattr(exc, 'filename', None) or self.root}: {exc}")

    def _lookup(self, keys: list[str]) -> int:
        for i, key in enumerate(keys):
            if not os.path.exists(f"{self._chunk_dir(key)}/{MARKER}"):
                if not os.path.isdir(self._root):  # deleted or unmounted: an outage, not a miss
                    raise StoreUnavailable(f"{self._root}: the store directory is gone")
                return i
        return len(keys)

    def _put(self, layer: int, objects: list[tuple[str, bytes, memoryview]]) -> None:
        for key, header, payload in objects:
            self._write_atomic(self._chunk_dir(key), f"{layer}.kv", (header, payload))

    def _get(self, layer: int, keys: list[str]) -> list[Buffer]:
        buffers = []
        for key in keys:
            chunk = self._chunk_dir(key)
            buffers.append(_read_file(f"{chunk}/{layer}.kv"))
            if layer == 0:
                self._touch(f"{chunk}/{MARKER}")
        return buffers

    def _get_into(self, layer: int, keys: list[str], out: list[torch.Tensor]) -> None:
        for key, tensor in zip(keys, out):
            chunk = self._chunk_dir(key)
            path = f"{chunk}/{layer}.kv"
            target = codec.tensor_bytes(tensor)
            header = bytearray(codec.HEADER_SIZE)
            fd = os.open(path, os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                if size != codec.HEADER_SIZE + target.nbytes:
                    raise CorruptObject(f"{path}: {size} bytes, expected {codec.HEADER_SIZE} + {target.nbytes} "
                                        f"for {list(tensor.shape)} {tensor.dtype}")
                _read_exact(fd, [memoryview(header), target], path)
            finally:
                os.close(fd)
            codec.decode_into(header, tensor, target, self.fingerprint, path)
            if layer == 0:
                self._touch(f"{chunk}/{MARKER}")

    def _commit(self, keys: list[str], num_layers: int) -> None:
        incomplete = []
        for key in keys:
            chunk = self._chunk_dir(key)
            try:
                size = sum(os.stat(os.path.join(chunk, f"{i}.kv")).st_size for i in range(num_layers))
            except FileNotFoundError:
                incomplete.append(key)
                continue
            try:  # no directory re-creation here: a marker must never appear in an evicted, empty chunk
                self._write_atomic(chunk, MARKER, (_MARKER.pack(_MARKER_MAGIC, 1, num_layers, size),), create=False)
            except FileNotFoundError:
                incomplete.append(key)
                continue
            self._touch(os.path.join(chunk, MARKER))
        if self.max_bytes is not None:
            self._enforce_bound()
        if incomplete:
            raise NotFound(f"{len(incomplete)} chunk(s) miss layers and stay invisible: {incomplete[0]}...")

    def _delete(self, keys: list[str]) -> int:
        return sum(self._remove_dir(self._chunk_dir(key)) for key in keys)

    def _chunk_infos(self, fingerprint: str | None) -> Iterator[ChunkInfo]:
        for fp, chunk in self._chunks(fingerprint):
            info = ChunkInfo(fp, os.path.basename(chunk), False, 0, 0)
            try:
                with os.scandir(chunk) as entries:
                    for entry in entries:
                        if entry.name == MARKER:
                            info.committed = True
                        elif entry.name.endswith(".kv") and not entry.name.startswith("."):
                            info.objects += 1
                            info.bytes += entry.stat().st_size
            except FileNotFoundError:  # evicted while we walked
                continue
            yield info

    def _iter_objects(self, fingerprint: str | None) -> Iterator[tuple[str, str, Buffer]]:
        for fp, chunk in self._chunks(fingerprint):
            for name in sorted(_list_visible(chunk)):
                if name.endswith(".kv"):
                    path = os.path.join(chunk, name)
                    try:
                        yield fp, path, _read_file(path)
                    except FileNotFoundError:  # evicted while we walked
                        continue

    def _clear(self, fingerprint: str | None) -> int:
        removed = sum(info.objects for info in self._chunk_infos(fingerprint))
        for fp in self._fingerprints(fingerprint):
            self._remove_dir(os.path.join(self.root, fp))
        return removed

    # ---- internals ----
    def _write_atomic(self, directory: str, name: str, parts: tuple[Buffer, ...], create: bool = True) -> None:
        """Temp file + rename; recreates the directory (once more if an evictor removed it meanwhile)."""
        for attempt in (0, 1):
            if create:
                os.makedirs(directory, exist_ok=True)
            tmp = os.path.join(directory, f".{name}.{uuid.uuid4().hex}.tmp")
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    _write_all(fd, parts)
                    if self.fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, os.path.join(directory, name))
                return
            except FileNotFoundError:
                if attempt or not create:
                    raise
            except BaseException:
                _unlink_quietly(tmp)
                raise

    def _touch(self, marker: str) -> None:
        """Advance the chunk's LRU clock (explicit ns: coarse filesystem clocks would tie)."""
        now = time.time_ns()
        try:
            os.utime(marker, ns=(now, now))
        except OSError:  # not committed yet, or evicted: nothing to refresh
            pass

    def _remove_dir(self, path: str) -> bool:
        """Rename away (atomic disappearance), then delete; False if it was already gone."""
        parent, name = os.path.split(path)
        doomed = os.path.join(parent, f".evict-{name}-{uuid.uuid4().hex}")
        try:
            os.rename(path, doomed)
        except FileNotFoundError:
            return False
        shutil.rmtree(doomed, ignore_errors=True)
        return True

    def _fingerprints(self, fingerprint: str | None) -> list[str]:
        if fingerprint is not None:
            return [fingerprint] if os.path.isdir(os.path.join(self.root, fingerprint)) else []
        return sorted(name for name in os.listdir(self.root) if _FP.fullmatch(name))

    def _chunks(self, fingerprint: str | None) -> Iterator[tuple[str, str]]:
        """(fingerprint, chunk directory) of every chunk, committed or not."""
        for fp in self._fingerprints(fingerprint):
            fp_dir = os.path.join(self.root, fp)
            for prefix in _list_visible(fp_dir):
                prefix_dir = os.path.join(fp_dir, prefix)
                for key in _list_visible(prefix_dir):
                    yield fp, os.path.join(prefix_dir, key)

    def _enforce_bound(self) -> None:
        """Evict least recently used chunks until the committed bytes fit in max_bytes."""
        with self._evict_lock:
            now = time.time()
            chunks = []  # (lru clock, chunk dir, bytes)
            for _, chunk in self._chunks(None):
                marker = os.path.join(chunk, MARKER)
                try:
                    mtime = os.stat(marker).st_mtime_ns
                    size = self._sizes.get(marker)
                    if size is None:
                        size = self._sizes[marker] = _marker_bytes(marker)
                except FileNotFoundError:
                    if _age(chunk, now) > ORPHAN_GRACE_S:
                        self._remove_dir(chunk)
                    continue
                chunks.append((mtime, chunk, size))
            total = sum(size for _, _, size in chunks)
            for _, chunk, size in sorted(chunks):
                if total <= self.max_bytes:
                    break
                if self._remove_dir(chunk):
                    logger.info("evicted chunk %s (%d bytes) to keep %s under max_bytes=%d",
                                os.path.basename(chunk), size, self.root, self.max_bytes)
                self._sizes.pop(os.path.join(chunk, MARKER), None)
                total -= size


def _read_file(path: str) -> bytearray:
    """Whole file into a fresh writable buffer (decoded copy-free by torch.frombuffer)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = bytearray(os.fstat(fd).st_size)
        got = _read_exact(fd, [memoryview(buf)], path, strict=False)
        return buf if got == len(buf) else buf[:got]  # short: decode reports the length mismatch
    finally:
        os.close(fd)


def _read_exact(fd: int, views: list[memoryview], path: str, strict: bool = True) -> int:
    """Fill the views from fd (readv, resuming after short reads); CorruptObject if the file ends
    early and `strict`, else the number of bytes read."""
    views = [v for v in views if v.nbytes]
    total = sum(v.nbytes for v in views)
    got = 0
    while views:
        n = os.readv(fd, views)
        if n == 0:
            if strict:
                raise CorruptObject(f"{path}: file ended after {got} of {total} bytes")
            return got
        got += n
        views = _advance(views, n)
    return got


def _write_all(fd: int, parts: tuple[Buffer, ...]) -> None:
    views = [v for v in (memoryview(p).cast("B") for p in parts) if v.nbytes]
    while views:
        views = _advance(views, os.writev(fd, views))


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    """The views left after the first n bytes were transferred."""
    while views and n >= views[0].nbytes:
        n -= views[0].nbytes
        views = views[1:]
    if views and n:
        views = [views[0][n:], *views[1:]]
    return views


def _marker_bytes(marker: str) -> int:
    with open(marker, "rb") as f:
        raw = f.read(_MARKER.size)
    if len(raw) != _MARKER.size or raw[:4] != _MARKER_MAGIC:
        return 0
    return _MARKER.unpack(raw)[3]


def _list_visible(directory: str) -> list[str]:
    try:
        return [name for name in os.listdir(directory) if not name.startswith(".")]
    except (FileNotFoundError, NotADirectoryError):
        return []


def _age(path: str, now: float) -> float:
    try:
        return now - os.stat(path).st_mtime
    except FileNotFoundError:
        return 0.0


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
