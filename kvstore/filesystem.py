"""file:///path backend: one directory tree shared by every node (local disk or NFS).

Layout: <root>/<fingerprint>/<key[:2]>/<key>/<layer>.kv plus <key>/commit, the marker that
makes the chunk visible. Every file is written to a hidden temp file in the same directory
and renamed into place, so readers see whole objects only and concurrent writers of the
same chunk simply replace each other's identical bytes. Removal renames the chunk
directory away first (one atomic step), then deletes it.

max_bytes bounds the bytes of layer objects under <root> (all fingerprints): committed, in flight
and orphaned (kvstore/fs_space.py: what counts, the default bound, a failed save's cleanup);
each put and each commit evict whole chunks, least recently used first, until the total fits. The totals
and the LRU order come from a ledger that every bounded store process appends to and replays
incrementally (kvstore.fs_ledger), so a commit costs O(log n) however many chunks the store
holds. The LRU clock is the marker's mtime, set at commit and refreshed whenever a reader
loads layer 0, so reads stay ledger-free and it works across processes and machines. Give
every process of one directory the same max_bytes (the default bound is the same for all of them): a
store opened with max_bytes=0 does not keep the ledger (its chunks are counted at the next reconciling
walk, every 10 minutes in the background, which also removes chunks that dead writers left half-written).

Commit markers and the commit rule are kvstore/fs_commit.py's; reads into caller memory (a load
straight into paged KV blocks, through its write gate) are kvstore/fs_read.py's.
"""
from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

from pdserve.kvstore import object_format
from pdserve.kvstore.base import KVStore
from pdserve.kvstore.errors import NotFound, StoreError, StoreTimeout, StoreUnavailable
from pdserve.kvstore import fs_ledger, fs_space
from pdserve.kvstore.fs_ledger import ChunkLedger
from pdserve.kvstore.fs_commit import MARKER, MARKER_FORMAT, MARKER_MAX, FileCommits, marker_bytes, parse_marker
from pdserve.kvstore.fs_read import FileReads, read_file
from pdserve.kvstore.layout import first_layer, parse_object_layer
from pdserve.kvstore.fs_space import InFlight, SpaceKeeping, age, free_bytes
from pdserve.kvstore.records import Buffer, ChunkInfo
from pdserve.kvstore.spans import advance

logger = logging.getLogger(__name__)

_KEY = re.compile(r"[0-9A-Za-z_-]{3,128}")
_FP = re.compile(r"[0-9a-f]{32}")
ORPHAN_GRACE_S = 120.0  # an uncommitted chunk untouched this long was left by a dead writer (a save takes
                        # save_timeout_s at most: 10 s by default)
ORPHAN_COUNTED_S = 30.0  # an uncommitted chunk of another writer untouched this long is no live save's: max_bytes
                         # counts it until ORPHAN_GRACE_S removes it (a live save's bytes are its own writer's to count)


class FileSystemStore(FileReads, FileCommits, SpaceKeeping, KVStore):
    def __init__(self, root: str | os.PathLike, *, max_bytes: int | None = None, fsync: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.root = Path(root)
        self._root = str(self.root)
        self.fsync = fsync
        self._nowait = hasattr(os, "RWF_NOWAIT")  # cleared the first time the filesystem refuses it
        self._objects_seen: dict[tuple, tuple[str, bytes]] = {}  # kvstore/fs_read.py, _layer_objects
        self._reconciling: threading.Thread | None = None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreUnavailable(f"cannot use {self.root} as a KV store: {exc.strerror}") from exc
        if not os.access(self.root, os.R_OK | os.W_OK | os.X_OK):
            raise StoreUnavailable(f"cannot use {self.root} as a KV store: permission denied")
        self.default_bound = max_bytes is None  # the nodes log which bound a store got (bounds_note)
        self.max_bytes = fs_space.default_max_bytes(self._root) if max_bytes is None else (max_bytes or None)
        self._ledger = ChunkLedger(self._root, self._walk_committed, self._marker_size) if self.max_bytes else None
        self._inflight = InFlight()  # this process's uncommitted chunks and failed saves (kvstore/fs_space.py)
        self._orphaned = 0  # bytes of stale uncommitted chunks not ours at the last reconciling walk
        self.sweep_after_s = fs_space.SWEEP_AFTER_S
        self._sweep_lock = threading.Lock()
        self._sweeper: threading.Thread | None = None
        self._closing = False

    # ---- paths ----
    def _chunk_dir(self, key: str, fingerprint: str | None = None) -> str:
        if not _KEY.fullmatch(key):
            raise ValueError(f"invalid chunk key {key!r}")
        return f"{self._root}/{fingerprint or self.fingerprint}/{key[:2]}/{key}"  # f-string: hot path

    def object_name(self, key: str, layer: int) -> str:
        return f"{self._chunk_dir(key)}/{layer}.kv"

    def bounds_warning(self) -> str | None:
        if self.max_bytes:
            return None
        return f"KV store {self.root} is unbounded (max_bytes=0): it grows until its disk is full"

    def bounds_note(self) -> str | None:
        if not self.max_bytes:
            return None
        how = (f"the default: the smaller of {fs_space.DEFAULT_CAP_BYTES / 2**30:g} GiB and "
               f"{fs_space.DEFAULT_FRACTION:.0%} of its {fs_space.filesystem_bytes(self._root) / 2**30:.1f} GiB "
               "filesystem; ?max_bytes= sets another") if self.default_bound else "max_bytes"
        return f"KV store {self.root}: bounded at {self.max_bytes / 2**30:.2f} GiB ({how}), least recently used " \
               "chunks evicted beyond it"

    # ---- hooks ----
    def _translate(self, exc: Exception) -> StoreError:
        if isinstance(exc, FileNotFoundError):
            return NotFound(f"{exc.filename}: no such object")
        if isinstance(exc, TimeoutError) or getattr(exc, "errno", None) == errno.ETIMEDOUT:
            return StoreTimeout(f"{getattr(exc, 'filename', '')}: {exc}")
        return StoreUnavailable(f"{getattr(exc, 'filename', None) or self.root}: {exc}")

    def _put(self, layer: int | str, objects: list[tuple[str, bytes, list[memoryview]]]) -> None:
        sizes = [len(header) + sum(p.nbytes for p in payload) for _, header, payload in objects]
        self._make_room(sum(sizes))
        try:
            for (key, header, payload), size in zip(objects, sizes):
                self._write_atomic(self._chunk_dir(key), f"{layer}.kv", (header, *payload))
                self._inflight.add(key, size)
        except OSError as exc:
            self._save_failed([key for key, _, _ in objects], exc, sum(sizes))
            raise

    def _get(self, items: list[tuple[int, str]]) -> list[Buffer]:
        buffers = []
        for layer, key in items:
            buffers.append(read_file(f"{self._chunk_dir(key)}/{layer}.kv"))
            if first_layer(layer):
                self._refresh(key)
        return buffers

    def _refresh(self, key: str) -> None:
        """A reader loaded chunk `key`'s layer 0: advance its LRU clock (as _touch, without reading it back)."""
        now = time.time_ns()
        try:
            os.utime(f"{self._chunk_dir(key)}/{MARKER}", ns=(now, now))
        except OSError:  # not committed yet, or evicted: nothing to refresh
            pass

    def _delete(self, keys: list[str]) -> int:
        removed = sum(self._remove_dir(self._chunk_dir(key)) for key in keys)
        if self._ledger is not None:
            rels = [f"{self.fingerprint}/{key}" for key in keys]
            with self._ledger.locked() as ledger:
                ledger.remove([rel for rel in rels if rel in ledger.sizes])
        return removed

    def _chunk_infos(self, fingerprint: str | None) -> Iterator[ChunkInfo]:
        now = time.time()
        for fp, chunk in self._chunks(fingerprint):
            info = ChunkInfo(fp, os.path.basename(chunk), False, 0, 0, orphaned=age(chunk, now) > ORPHAN_GRACE_S)
            try:
                with os.scandir(chunk) as entries:
                    for entry in entries:
                        if entry.name == MARKER:
                            info.committed = True
                        elif entry.name.endswith(".kv") and not entry.name.startswith("."):
                            info.count_object(entry.stat().st_size, _head(entry.path))
            except FileNotFoundError:  # evicted while we walked
                continue
            yield info

    def _iter_objects(self, fingerprint: str | None) -> Iterator[tuple[str, str, int | str, str, Buffer]]:
        for fp, chunk in self._chunks(fingerprint):
            key = os.path.basename(chunk)
            for name in sorted(_list_visible(chunk)):
                if name.endswith(".kv"):
                    path = os.path.join(chunk, name)
                    layer = parse_object_layer(name[:-3])
                    layer = -1 if layer is None else layer  # -1: no layer binds to it
                    try:
                        yield fp, key, layer, path, read_file(path)
                    except FileNotFoundError:  # evicted while we walked
                        continue

    def _clear(self, fingerprint: str | None) -> int:
        removed = sum(info.objects for info in self._chunk_infos(fingerprint))
        for fp in self._fingerprints(fingerprint):
            self._remove_dir(os.path.join(self.root, fp))
        for name in (fs_ledger.LEDGER, fs_ledger.WALKED):  # bounded stores rebuild the ledger with one walk
            _unlink_quietly(os.path.join(self.root, name))
        return removed

    def _committed_chunks(self, fingerprint: str | None) -> Iterator[tuple[str, str]]:
        for fp, chunk in self._chunks(fingerprint):
            if self._committed_dir(chunk):
                yield fp, os.path.basename(chunk)

    def _damage(self, fingerprint: str, key: str) -> tuple[str | None, list[int | str]]:
        chunk = self._chunk_dir(key, fingerprint)
        try:
            with open(f"{chunk}/{MARKER}", "rb") as f:
                raw = f.read(MARKER_MAX + 1)
        except FileNotFoundError:
            return None, []
        if not raw:
            return "empty commit marker", []
        layout = parse_marker(raw)
        if layout is None:
            return "corrupted commit marker", []
        names = layout.object_layers(layout.num_kv_heads)
        found = 0
        for name in names:
            try:
                found += os.stat(f"{chunk}/{name}.kv").st_size
            except FileNotFoundError:
                return f"layer {name} of {layout.num_layers} missing", names
        size = MARKER_FORMAT.unpack_from(raw)[3]
        return (None if found == size else f"layers hold {found} bytes, the marker says {size}"), names

    def _uncommit(self, fingerprint: str, key: str) -> bool:
        removed = self._remove_dir(self._chunk_dir(key, fingerprint))  # marker and layers vanish in one rename
        if self._ledger is not None:
            rel = f"{fingerprint}/{key}"
            with self._ledger.locked() as ledger:
                ledger.remove([rel] if rel in ledger.sizes else [])
        return removed

    def _close(self) -> None:
        with self._sweep_lock:
            self._closing = True  # the pool has stopped: no put of a failed save is left, sweep now
            sweeper = self._sweeper
        self._inflight.wake.set()
        if sweeper is not None:
            sweeper.join()
        if self._reconciling is not None:
            self._reconciling.join()
        if self._ledger is not None:
            self._ledger.close()

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

    def _committed_dir(self, chunk: str) -> bool:
        return os.path.exists(f"{chunk}/{MARKER}")

    def _touch(self, marker: str) -> int:
        """Advance the chunk's LRU clock (explicit ns: coarse filesystem clocks would tie); returns it
        as the filesystem stored it (0 if the marker is gone)."""
        now = time.time_ns()
        try:
            os.utime(marker, ns=(now, now))
            return os.stat(marker).st_mtime_ns
        except OSError:  # not committed yet, or evicted: nothing to refresh
            return 0

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

    def _evict(self, ledger: ChunkLedger, incoming: int = 0, need_free: int = 0) -> None:
        """Evict least recently used chunks until committed, in-flight and orphaned bytes plus `incoming`
        fit in max_bytes and the filesystem has `need_free` bytes free (ledger locked)."""
        extra = self._inflight.total + self._orphaned + incoming
        while (ledger.total + extra > self.max_bytes or (need_free and free_bytes(self._root) < need_free)) \
                and (head := ledger.oldest()) is not None:
            clock, rel = head
            fp, _, key = rel.partition("/")
            chunk = self._chunk_dir(key, fp)
            try:
                mtime = os.stat(f"{chunk}/{MARKER}").st_mtime_ns
            except FileNotFoundError:  # deleted behind the ledger's back
                ledger.remove([rel])
                continue
            if mtime > clock:  # read since: put it back with its real clock
                ledger.refresh(rel, mtime)
                continue
            size = ledger.sizes[rel]
            if self._remove_dir(chunk):
                logger.info("evicted chunk %s (%d bytes) to keep %s under max_bytes=%d", key, size, self.root,
                            self.max_bytes)
            ledger.remove([rel])

    def reconcile(self) -> tuple[int, int]:
        """Walk the tree and fix the max_bytes ledger against it (runs in the background every
        fs_ledger.RECONCILE_S); removes chunks a dead writer left half-written. Returns (added, dropped)."""
        if self._ledger is None:
            raise ValueError("reconcile applies to stores opened with max_bytes")
        added, dropped = self._ledger.reconcile()
        if added or dropped:
            logger.info("KV store %s: ledger reconciled with the disk (%d chunk(s) added, %d dropped)", self.root,
                        added, dropped)
        with self._ledger.locked() as ledger:
            self._evict(ledger)
        return added, dropped

    def _reconcile_quietly(self) -> None:
        try:
            self.reconcile()
        except Exception as exc:  # a background chore: the next one retries
            logger.warning("KV store %s: reconciling the max_bytes ledger failed: %s", self.root, exc)

    def _walk_committed(self) -> Iterator[tuple[str, int]]:
        """(fingerprint/key, LRU clock) of every committed chunk on disk; removes uncommitted chunks
        untouched for ORPHAN_GRACE_S (their writer died)."""
        now, orphaned = time.time(), 0
        for fp, chunk in self._chunks(None):
            try:
                clock = os.stat(os.path.join(chunk, MARKER)).st_mtime_ns
            except FileNotFoundError:
                idle = age(chunk, now)
                if idle > ORPHAN_GRACE_S:
                    self._remove_dir(chunk)
                elif idle > ORPHAN_COUNTED_S and not (fp == self.fingerprint and os.path.basename(chunk) in self._inflight):
                    orphaned += _dir_bytes(chunk)  # a writer that died or stalled: max_bytes counts it until removed
                continue
            yield f"{fp}/{os.path.basename(chunk)}", clock
        self._orphaned = orphaned

    def _marker_size(self, rel: str) -> int | None:
        fp, _, key = rel.partition("/")
        try:
            return marker_bytes(f"{self._chunk_dir(key, fp)}/{MARKER}")
        except FileNotFoundError:
            return None


def _write_all(fd: int, parts: tuple[Buffer, ...]) -> None:
    views = [v for v in (memoryview(p).cast("B") for p in parts) if v.nbytes]
    while views:
        views = advance(views, os.writev(fd, views))



def _head(path: str) -> bytes:
    """An object's header bytes (b"" when it vanished meanwhile)."""
    try:
        with open(path, "rb") as f:
            return f.read(object_format.HEADER_SIZE)
    except FileNotFoundError:
        return b""


def _list_visible(directory: str) -> list[str]:
    try:
        return [name for name in os.listdir(directory) if not name.startswith(".")]
    except (FileNotFoundError, NotADirectoryError):
        return []


def _dir_bytes(path: str) -> int:
    try:
        with os.scandir(path) as entries:
            return sum(entry.stat().st_size for entry in entries if entry.is_file())
    except FileNotFoundError:
        return 0


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
