"""The shared tally behind a file store's max_bytes: which chunks are committed, their bytes, and an LRU clock.

A bounded file store must know the bytes of every committed chunk (whoever wrote it) and
which one was used least recently, without walking the whole tree on every commit (at 100k
chunks that walk costs seconds). Every bounded store process therefore appends to one
ledger file under the root and replays only what others appended since its last look:

    <root>/.ledger        lines "+ <fingerprint>/<key> <bytes> <clock_ns>" (committed) and
                          "- <fingerprint>/<key>" (evicted or deleted)
    <root>/.ledger.lock   flock()ed around every read-modify-append, so appends never interleave

The clock in a "+" line is the commit marker's mtime at commit. Readers move a chunk's LRU
clock forward by touching its marker (no ledger write on the read path), so the clock a
ledger holds is a lower bound of the real one: `oldest()` hands out the smallest recorded
clock, and the evictor re-reads that chunk's marker mtime before evicting, putting it back
with its real clock when a reader refreshed it. The chunk finally evicted has the smallest
real clock of all: exact LRU at O(log n) per eviction.

The file is rewritten from the live entries (compaction: temp file + rename) once it holds
more than twice as many lines as live chunks; other processes notice the new inode and
replay it from the start. A missing ledger (a new store, or one written by an older
pdserve) is rebuilt by one directory walk under the lock. Every RECONCILE_S one process
walks the tree again in the background, without the lock, and then fixes the ledger under
it: chunks that stores opened without max_bytes committed are added, entries whose chunk
vanished are dropped, and the walk removes chunks that dead writers left half-written.
"""
from __future__ import annotations

import contextlib
import fcntl
import heapq
import os
import threading
import time
import uuid
from typing import Callable, Iterable, Iterator

LEDGER = ".ledger"
LOCK = ".ledger.lock"
WALKED = ".ledger.walked"  # its mtime: when some process last started a reconciling walk
COMPACT_SLACK = 4096  # lines beyond 2x the live chunks before a rewrite
RECONCILE_S = 600.0

Entry = tuple[str, int, int]  # (fingerprint/key, bytes, clock ns)


class ChunkLedger:
    """This process's replay of the shared ledger; use every method inside `locked()`."""

    def __init__(self, root: str, walk: Callable[[], Iterable[tuple[str, int]]],
                 size_of: Callable[[str], int | None]) -> None:
        self.path = os.path.join(root, LEDGER)
        self._lock_path = os.path.join(root, LOCK)
        self._walked_path = os.path.join(root, WALKED)
        self._walk = walk  # (fingerprint/key, clock) of every committed chunk on disk
        self._size_of = size_of  # a committed chunk's bytes from its marker; None if it is gone
        self._thread_lock = threading.Lock()  # flock is per open file: threads of one process queue here
        self._lock_fd: int | None = None
        self._fd: int | None = None
        self._ino: int | None = None
        self._offset = 0
        self._tail = b""  # an incomplete last line (a writer died mid-append)
        self.sizes: dict[str, int] = {}
        self.clocks: dict[str, int] = {}
        self._heap: list[tuple[int, str]] = []
        self.total = 0  # bytes of the committed chunks
        self.lines = 0
        self.disk_scans = 0  # full directory walks this process did (bootstrap and compaction)

    @contextlib.contextmanager
    def locked(self) -> Iterator[ChunkLedger]:
        """Hold the ledger lock (threads and processes) and bring the replay up to date."""
        with self._thread_lock:
            if self._lock_fd is None:
                self._lock_fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                self._sync()
                yield self
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def add(self, entries: list[Entry]) -> None:
        self._append([f"+ {rel} {size} {clock}\n" for rel, size, clock in entries])

    def remove(self, rels: list[str]) -> None:
        self._append([f"- {rel}\n" for rel in rels])

    def oldest(self) -> tuple[int, str] | None:
        """(recorded clock, fingerprint/key) of the chunk with the smallest recorded clock."""
        while self._heap:
            clock, rel = self._heap[0]
            if self.clocks.get(rel) == clock:
                return clock, rel
            heapq.heappop(self._heap)  # stale: removed, or refreshed with a later clock
        return None

    def refresh(self, rel: str, clock: int) -> None:
        """A reader moved this chunk's clock forward: remember it (in this process only)."""
        self.clocks[rel] = clock
        heapq.heappush(self._heap, (clock, rel))

    def maybe_compact(self) -> None:
        """Rewrite the ledger from the live entries when it has grown well past them."""
        if self.lines > 2 * len(self.sizes) + COMPACT_SLACK:
            self._rewrite([(rel, size, self.clocks[rel]) for rel, size in self.sizes.items()])

    def reconcile_due(self) -> bool:
        """True (once, for one process) when the last reconciling walk is RECONCILE_S old; call locked."""
        try:
            if time.time() - os.stat(self._walked_path).st_mtime < RECONCILE_S:
                return False
        except FileNotFoundError:
            pass
        _touch(self._walked_path)
        return True

    def reconcile(self) -> tuple[int, int]:
        """Walk the tree (unlocked: commits go on meanwhile), then fix the ledger against it (locked);
        returns (entries added, entries dropped)."""
        self.disk_scans += 1
        on_disk = dict(self._walk())
        with self.locked():
            gone = [rel for rel in self.sizes if rel not in on_disk and self._size_of(rel) is None]
            found = [(rel, size, clock) for rel, clock in on_disk.items()
                     if rel not in self.sizes and (size := self._size_of(rel)) is not None]
            self.remove(gone)
            self.add(found)
        return len(found), len(gone)

    def _rebuild(self) -> None:
        """A ledger from a directory walk (the truth on disk): for a store that has none yet."""
        self.disk_scans += 1
        _touch(self._walked_path)
        self._rewrite([(rel, size, clock) for rel, clock in self._walk()
                       if (size := self._size_of(rel)) is not None])

    def _rewrite(self, entries: list[Entry]) -> None:
        tmp = f"{self.path}.{uuid.uuid4().hex}.tmp"
        with open(tmp, "w") as f:
            f.writelines(f"+ {rel} {size} {clock}\n" for rel, size, clock in entries)
        os.replace(tmp, self.path)
        self._open()

    def close(self) -> None:
        for fd in (self._fd, self._lock_fd):
            if fd is not None:
                os.close(fd)
        self._fd = self._lock_fd = None

    # ---- internals ----
    def _sync(self) -> None:
        try:
            ino = os.stat(self.path).st_ino
        except FileNotFoundError:
            self._rebuild()
            return
        if ino != self._ino:  # first look, or another process compacted or removed it
            self._open()
            return
        self._replay()

    def _open(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND)
        self._ino = os.fstat(self._fd).st_ino
        self._offset, self._tail, self.lines, self.total = 0, b"", 0, 0
        self.sizes, self.clocks, self._heap = {}, {}, []
        self._replay()
        if len(self._heap) > 2 * len(self.sizes):
            self._heap = [(clock, rel) for rel, clock in self.clocks.items()]
            heapq.heapify(self._heap)

    def _replay(self) -> None:
        while chunk := os.pread(self._fd, 1 << 20, self._offset):
            self._offset += len(chunk)
            data = self._tail + chunk
            complete, _, self._tail = data.rpartition(b"\n")
            for line in complete.split(b"\n") if complete else ():
                self._apply(line)

    def _apply(self, line: bytes) -> None:
        parts = line.split()
        self.lines += 1
        if len(parts) == 4 and parts[0] == b"+" and parts[2].isdigit() and parts[3].isdigit():
            rel, size, clock = parts[1].decode(), int(parts[2]), int(parts[3])
            self.total += size - self.sizes.get(rel, 0)
            self.sizes[rel] = size
            if clock > self.clocks.get(rel, -1):
                self.clocks[rel] = clock
                heapq.heappush(self._heap, (clock, rel))
        elif len(parts) == 2 and parts[0] == b"-":
            rel = parts[1].decode()
            self.total -= self.sizes.pop(rel, 0)
            self.clocks.pop(rel, None)
        # anything else: a line cut short by a writer that died; ignored

    def _append(self, lines: list[str]) -> None:
        if not lines:
            return
        data = "".join(lines).encode()
        if self._tail:  # terminate a dead writer's partial line so ours parse
            data = b"\n" + data
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]
        self._replay()  # under the lock nobody else appended: this reads back exactly our lines


def _touch(path: str) -> None:
    with open(path, "a"):
        pass
    os.utime(path)
