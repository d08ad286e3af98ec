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
"""
from __future__ import annotations

import errno
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.kvstore.fs_ledger import ChunkLedger

logger = logging.getLogger(__name__)

DEFAULT_CAP_BYTES = 20 * 2**30
DEFAULT_FRACTION = 0.10
SWEEP_AFTER_S = 2.0  # a failed save's chunk quiet this long has no put of that save left in flight
SWEEP_LIMIT_S = 60.0  # after this, a failed save's chunk is removed even if something still writes it
WRITE_RESERVE_BYTES = 1 << 20  # free space kept beyond the object being written (directories, temp names)


def default_max_bytes(path: str) -> int:
    """The default bound of a file store at `path`: min(20 GiB, 10% of its filesystem)."""
    st = os.statvfs(path)
    return min(DEFAULT_CAP_BYTES, int(st.f_blocks * st.f_frsize * DEFAULT_FRACTION))


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


def age(path: str, now: float) -> float:
    """Seconds since `path` (a chunk directory: every put renames a file into it) last changed; 0 if gone."""
    try:
        return now - os.stat(path).st_mtime
    except FileNotFoundError:
        return 0.0


class SpaceKeeping:
    """The FileSystemStore half that makes room before writes and cleans up after failed saves."""

    root: Any
    _root: str
    max_bytes: int | None
    sweep_after_s: float
    _ledger: ChunkLedger | None
    _inflight: InFlight
    _orphaned: int
    _sweep_lock: threading.Lock
    _sweeper: threading.Thread | None
    _closing: bool
    _chunk_dir: Any
    _committed_dir: Any
    _remove_dir: Any
    _evict: Any

    def _make_room(self, incoming: int) -> None:
        """Evict before a put of `incoming` bytes when it would not fit the bound or the disk (kvstore/fs_space.py)."""
        ledger = self._ledger
        if ledger is None:
            return
        need_free = incoming + WRITE_RESERVE_BYTES
        # the unlocked look reads this process's last replay of the ledger: cheap, and the commit corrects it
        if ledger.total + self._inflight.total + self._orphaned + incoming <= self.max_bytes and \
                free_bytes(self._root) >= need_free:
            return
        with ledger.locked():
            self._evict(ledger, incoming, need_free)

    def _save_failed(self, keys: list[str], exc: OSError, incoming: int) -> None:
        """A put failed: remove what the save wrote, make room on a full disk, sweep its later layers."""
        self._inflight.fail(keys)
        for key in keys:
            self._remove_uncommitted(key)
        logger.warning("KV store %s: a save of %d chunk(s) failed (%s); removed what it wrote, its later layers "
                       "are swept after %.1f s quiet", self.root, len(keys), exc.strerror or exc, self.sweep_after_s)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT) and self._ledger is not None:
            with self._ledger.locked() as ledger:
                self._evict(ledger, incoming, incoming + WRITE_RESERVE_BYTES)
        with self._sweep_lock:
            if self._sweeper is None and not self._closing:
                self._sweeper = threading.Thread(target=self._sweep_failed, name="kvstore-sweep", daemon=True)
                self._sweeper.start()

    def _remove_uncommitted(self, key: str) -> bool:
        chunk = self._chunk_dir(key)
        return not self._committed_dir(chunk) and self._remove_dir(chunk)

    def _sweep_failed(self) -> None:
        """Remove failed saves' chunks once they have been quiet sweep_after_s (or SWEEP_LIMIT_S after the
        failure); exits when none is left. A chunk a later save committed meanwhile is kept."""
        while True:
            self._inflight.wake.wait(self.sweep_after_s)
            now, wall = time.monotonic(), time.time()
            done = []
            for key, failed_at in self._inflight.failed().items():
                chunk = self._chunk_dir(key)
                if not os.path.isdir(chunk) or self._committed_dir(chunk):
                    done.append(key)
                elif self._closing or age(chunk, wall) >= self.sweep_after_s or \
                        now - failed_at >= SWEEP_LIMIT_S:
                    self._remove_uncommitted(key)
                    done.append(key)
            self._inflight.forget_failed(done)
            with self._sweep_lock:
                if not self._inflight.failed():
                    self._sweeper = None
                    return
