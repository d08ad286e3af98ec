"""How a file store stays within its bound and never wedges on a full disk.

The bound. A file store is bounded by default: the smaller of DEFAULT_CAP_BYTES and
DEFAULT_FRACTION of its filesystem (`default_max_bytes`, the one owner of that rule; the nodes
log it at start-up, `make serve` passes no bound of its own). `?max_bytes=0` asks for no bound.

What counts. max_bytes covers every byte a store process knows of under the root: committed
chunks (the shared ledger, kvstore/fs_ledger.py), chunks this process is writing and has not
committed yet (in-flight), and uncommitted chunks left by others that the last reconciling walk
saw (orphaned), plus the object about to be written. A put evicts least recently used chunks
*before* it writes until all that fits, and also until the filesystem itself has room for it
(statvfs: the disk may be shared with other data, or smaller than the bound), so a full disk
costs at most the one eviction, never a stream of failed saves.

A failed save. A put that fails (ENOSPC, EIO, ...) removes the uncommitted chunks it was writing
at once (best effort; a full disk also evicts room for the next save), and the store remembers
them: a connector keeps putting the save's later layers, so a sweep SWEEP_AFTER_S later removes
whatever was written since, as soon as the chunk has been quiet that long, without waiting for a
later successful save. `InFlight` is that per-process tally and the failed set.

`SpaceKeeper` is the member of kvstore.filesystem.FileSystemStore that does all of it: it holds the
ledger, the bound, the in-flight tally and the background sweeps and reconciling walks.
"""
from __future__ import annotations

import errno
import logging
import os
import threading
import time
from typing import Iterator

from pdserve.kvstore.binding import ModelBinding
from pdserve.kvstore.fs_commit import marker_bytes
from pdserve.kvstore.fs_ledger import ChunkLedger, Entry
from pdserve.kvstore.fs_tree import MARKER, ChunkTree, age, dir_bytes

logger = logging.getLogger(__name__)

DEFAULT_CAP_BYTES = 20 * 2**30
DEFAULT_FRACTION = 0.10
FEW_PROMPTS = 4  # a bound holding fewer of a node's longest prompts evicts their chunks before decodes read them
SWEEP_AFTER_S = 2.0  # a failed save's chunk quiet this long has no put of that save left in flight
SWEEP_LIMIT_S = 60.0  # after this, a failed save's chunk is removed even if something still writes it
WRITE_RESERVE_BYTES = 1 << 20  # free space kept beyond the object being written (directories, temp names)
ORPHAN_GRACE_S = 120.0  # an uncommitted chunk untouched this long was left by a dead writer (a save takes
                        # save_timeout_s at most: 10 s by default)
ORPHAN_COUNTED_S = 30.0  # an uncommitted chunk of another writer untouched this long is no live save's: max_bytes
                         # counts it until ORPHAN_GRACE_S removes it (a live save's bytes are its own writer's to count)


def default_max_bytes(path: str) -> int:
    """The default bound of a file store at `path`: min(20 GiB, 10% of its filesystem)."""
    st = os.statvfs(path)
    return min(DEFAULT_CAP_BYTES, int(st.f_blocks * st.f_frsize * DEFAULT_FRACTION))


def capacity_warning(root: str, max_bytes: int | None, default_bound: bool, chunk_bytes: int | None, exact: bool,
                     chunk_tokens: int, prompt_tokens: int) -> str | None:
    """Whether a bound of `max_bytes` keeps a node's chunks (`chunk_bytes` each, of `chunk_tokens` tokens; `exact`:
    not an estimate) long enough to be read: ValueError when it cannot hold one chunk (every chunk would be
    evicted as it is stored: 0 hits), one warning line when it holds fewer than FEW_PROMPTS prompts of
    `prompt_tokens` tokens, else None. Each says what to set."""
    if not max_bytes or not chunk_bytes:
        return None
    prompt = -(-prompt_tokens // chunk_tokens) * chunk_bytes
    which = f"the default bound: {DEFAULT_FRACTION:.0%} of its {filesystem_bytes(root)}-byte filesystem" \
        if default_bound else "its max_bytes"
    advice = f"set ?max_bytes= in the store URL to at least {FEW_PROMPTS * prompt} (or 0: no bound)"
    if max_bytes < chunk_bytes and exact:
        raise ValueError(f"KV store {root}: {max_bytes} bytes ({which}) cannot hold one chunk of {chunk_tokens} "
                         f"tokens ({chunk_bytes} bytes): every chunk would be evicted as it is stored; {advice}")
    if max_bytes < FEW_PROMPTS * prompt:
        return (f"KV store {root}: {max_bytes} bytes ({which}) hold {max_bytes // chunk_bytes} chunk(s) of "
                f"{chunk_tokens} tokens, fewer than {FEW_PROMPTS} prompts of {prompt_tokens} tokens: chunks are "
                f"evicted before a decode reads them; {advice}")
    return None


def filesystem_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still write on the filesystem holding `path` (unknown, so
    unlimited, while the root is gone: the put recreates it, or fails and says why)."""
    try:
        st = os.statvfs(path)
    except FileNotFoundError:
        return 1 << 62
    return st.f_bavail * st.f_frsize


class InFlight:
    """This process's uncommitted chunks (key -> bytes written) and its failed saves' chunks (key -> when)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes: dict[str, int] = {}
        self.total = 0
        self._failed: dict[str, float] = {}
        self.wake = threading.Event()  # set by close(): the sweep runs at once

    def add(self, key: str, nbytes: int) -> None:
        """Count a put's bytes; not those of a failed save's later layers (the sweep removes them)."""
        with self._lock:
            if key in self._failed:
                return
            self._bytes[key] = self._bytes.get(key, 0) + nbytes
            self.total += nbytes

    def drop(self, keys: list[str]) -> None:
        with self._lock:
            for key in keys:
                self.total -= self._bytes.pop(key, 0)

    def __contains__(self, key: str) -> bool:
        return key in self._bytes

    def fail(self, keys: list[str]) -> None:
        now = time.monotonic()
        with self._lock:
            for key in keys:
                self.total -= self._bytes.pop(key, 0)
                self._failed.setdefault(key, now)

    def failed(self) -> dict[str, float]:
        with self._lock:
            return dict(self._failed)

    def forget_failed(self, keys: list[str]) -> None:
        with self._lock:
            for key in keys:
                self._failed.pop(key, None)


class SpaceKeeper:
    """Keeps the chunks in `tree` (of the store bound to `model`) within `max_bytes` (None: unbounded, no
    ledger) and cleans up after failed saves: the shared ledger of committed chunks (kvstore/fs_ledger.py),
    this process's in-flight tally, the orphaned bytes of the last reconciling walk, and the threads of
    the failed-save sweep and of the reconciling walk."""

    def __init__(self, tree: ChunkTree, model: ModelBinding, max_bytes: int | None) -> None:
        self._tree = tree
        self._model = model
        self.max_bytes = max_bytes
        self.ledger = ChunkLedger(tree.root, self.walk_committed, self._marker_size) if max_bytes else None
        self.inflight = InFlight()  # this process's uncommitted chunks and failed saves
        self._orphaned = 0  # bytes of stale uncommitted chunks not ours at the last reconciling walk
        self.sweep_after_s = SWEEP_AFTER_S
        self._sweep_lock = threading.Lock()
        self._sweeper: threading.Thread | None = None
        self._closing = False
        self._reconciling: threading.Thread | None = None

    def committed(self, keys: list[str], entries: list[Entry]) -> None:
        """`keys` are no longer in flight; `entries` were committed: count them, evict beyond the bound, and
        start the reconciling walk when one is due."""
        self.inflight.drop(keys)
        if self.ledger is None:
            return
        with self.ledger.locked() as ledger:
            ledger.add(entries)
            self._evict(ledger)
            ledger.maybe_compact()
            due = ledger.reconcile_due()
        if due and not (self._reconciling and self._reconciling.is_alive()):
            self._reconciling = threading.Thread(target=self._reconcile_quietly, name="kvstore-reconcile",
                                                 daemon=True)
            self._reconciling.start()

    def forget(self, rels: list[str]) -> None:
        """Chunks (fingerprint/key) deleted or un-committed: out of the ledger."""
        if self.ledger is not None:
            with self.ledger.locked() as ledger:
                ledger.remove([rel for rel in rels if rel in ledger.sizes])

    def _evict(self, ledger: ChunkLedger, incoming: int = 0, need_free: int = 0) -> None:
        """Evict least recently used chunks until committed, in-flight and orphaned bytes plus `incoming`
        fit in max_bytes and the filesystem has `need_free` bytes free (ledger locked)."""
        assert self.max_bytes is not None  # a ledger exists only for a bound
        extra = self.inflight.total + self._orphaned + incoming
        while (ledger.total + extra > self.max_bytes or (need_free and free_bytes(self._tree.root) < need_free)) \
                and (head := ledger.oldest()) is not None:
            clock, rel = head
            fp, _, key = rel.partition("/")
            chunk = self._tree.chunk_dir(key, fp)
            try:
                mtime = os.stat(f"{chunk}/{MARKER}").st_mtime_ns
            except FileNotFoundError:  # deleted behind the ledger's back
                ledger.remove([rel])
                continue
            if mtime > clock:  # read since: put it back with its real clock
                ledger.refresh(rel, mtime)
                continue
            size = ledger.sizes[rel]
            if self._tree.remove_dir(chunk):
                logger.info("evicted chunk %s (%d bytes) to keep %s under max_bytes=%d", key, size, self._tree.root,
                            self.max_bytes)
            ledger.remove([rel])

    def reconcile(self) -> tuple[int, int]:
        """Walk the tree and fix the max_bytes ledger against it (runs in the background every
        fs_ledger.RECONCILE_S); removes chunks a dead writer left half-written. Returns (added, dropped)."""
        if self.ledger is None:
            raise ValueError("reconcile applies to stores opened with max_bytes")
        added, dropped = self.ledger.reconcile()
        if added or dropped:
            logger.info("KV store %s: ledger reconciled with the disk (%d chunk(s) added, %d dropped)",
                        self._tree.root, added, dropped)
        with self.ledger.locked() as ledger:
            self._evict(ledger)
        return added, dropped

    def _reconcile_quietly(self) -> None:
        try:
            self.reconcile()
        except Exception as exc:  # a background chore: the next one retries
            logger.warning("KV store %s: reconciling the max_bytes ledger failed: %s", self._tree.root, exc)

    def walk_committed(self) -> Iterator[tuple[str, int]]:
        """(fingerprint/key, LRU clock) of every committed chunk on disk; removes uncommitted chunks
        untouched for ORPHAN_GRACE_S (their writer died)."""
        now, orphaned = time.time(), 0
        for fp, chunk in self._tree.chunks(None):
            try:
                clock = os.stat(os.path.join(chunk, MARKER)).st_mtime_ns
            except FileNotFoundError:
                idle = age(chunk, now)
                if idle > ORPHAN_GRACE_S:
                    self._tree.remove_dir(chunk)
                elif idle > ORPHAN_COUNTED_S and not (fp == self._model.fingerprint
                                                      and os.path.basename(chunk) in self.inflight):
                    orphaned += dir_bytes(chunk)  # a writer that died or stalled: max_bytes counts it until removed
                continue
            yield f"{fp}/{os.path.basename(chunk)}", clock
        self._orphaned = orphaned

    def _marker_size(self, rel: str) -> int | None:
        fp, _, key = rel.partition("/")
        chunk = self._tree.chunk_dir(key, fp)
        try:
            recorded = marker_bytes(f"{chunk}/{MARKER}")
        except FileNotFoundError:
            return None
        return min(recorded, dir_bytes(chunk))  # a damaged marker's number never counts more than the chunk holds

    def close(self) -> None:
        """After the store's I/O pool stopped (no put of a failed save is left): sweep now, wait for the
        background threads, close the ledger."""
        with self._sweep_lock:
            self._closing = True
            sweeper = self._sweeper
        self.inflight.wake.set()
        if sweeper is not None:
            sweeper.join()
        if self._reconciling is not None:
            self._reconciling.join()
        if self.ledger is not None:
            self.ledger.close()

    def make_room(self, incoming: int) -> None:
        """Evict before a put of `incoming` bytes when it would not fit the bound or the disk (see the module docstring)."""
        ledger = self.ledger
        if ledger is None:
            return
        need_free = incoming + WRITE_RESERVE_BYTES
        # the unlocked look reads this process's last replay of the ledger: cheap, and the commit corrects it
        if ledger.total + self.inflight.total + self._orphaned + incoming <= self.max_bytes and \
                free_bytes(self._tree.root) >= need_free:
            return
        with ledger.locked():
            self._evict(ledger, incoming, need_free)

    def save_failed(self, keys: list[str], exc: OSError, incoming: int) -> None:
        """A put failed: remove what the save wrote, make room on a full disk, sweep its later layers."""
        self.inflight.fail(keys)
        for key in keys:
            self._remove_uncommitted(key)
        logger.warning("KV store %s: a save of %d chunk(s) failed (%s); removed what it wrote, its later layers "
                       "are swept after %.1f s quiet", self._tree.root, len(keys), exc.strerror or exc, self.sweep_after_s)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT) and self.ledger is not None:
            with self.ledger.locked() as ledger:
                self._evict(ledger, incoming, incoming + WRITE_RESERVE_BYTES)
        with self._sweep_lock:
            if self._sweeper is None and not self._closing:
                self._sweeper = threading.Thread(target=self._sweep_failed, name="kvstore-sweep", daemon=True)
                self._sweeper.start()

    def _remove_uncommitted(self, key: str) -> bool:
        chunk = self._tree.chunk_dir(key)
        return not self._tree.committed(chunk) and self._tree.remove_dir(chunk)

    def _sweep_failed(self) -> None:
        """Remove failed saves' chunks once they have been quiet sweep_after_s (or SWEEP_LIMIT_S after the
        failure); exits when none is left. A chunk a later save committed meanwhile is kept."""
        while True:
            self.inflight.wake.wait(self.sweep_after_s)
            now, wall = time.monotonic(), time.time()
            done = []
            for key, failed_at in self.inflight.failed().items():
                chunk = self._tree.chunk_dir(key)
                if not os.path.isdir(chunk) or self._tree.committed(chunk):
                    done.append(key)
                elif self._closing or age(chunk, wall) >= self.sweep_after_s or \
                        now - failed_at >= SWEEP_LIMIT_S:
                    self._remove_uncommitted(key)
                    done.append(key)
            self.inflight.forget_failed(done)
            with self._sweep_lock:
                if not self.inflight.failed():
                    self._sweeper = None
                    return
