"""A file store's directory tree: where each chunk and object lives, and the atomic steps that change it.

    <root>/<fingerprint>/<key[:2]>/<key>/<layer>.kv      a layer object (kvstore/object_format.py)
    <root>/<fingerprint>/<key[:2]>/<key>/commit          its commit marker (kvstore/fs_commit.py)

Every file is written to a hidden temp file in the same directory and renamed into place, so readers
see whole files only and concurrent writers of the same chunk simply replace each other's identical
bytes. Removal renames the chunk directory away first (one atomic step), then deletes it. The marker's
mtime is the chunk's LRU clock (kvstore/fs_ledger.py): set at commit, advanced when a reader loads layer 0.
"""
from __future__ import annotations

import os
import re
import shutil
import time
import uuid
from typing import Iterator

from pdserve.kvstore.binding import ModelBinding
from pdserve.kvstore.records import Buffer
from pdserve.kvstore.spans import advance

MARKER = "commit"
_KEY = re.compile(r"[0-9A-Za-z_-]{3,128}")
_FP = re.compile(r"[0-9a-f]{32}")


class ChunkTree:
    """The tree under `root` (str: paths are built with f-strings on the hot path) of the store bound to
    `model` (its fingerprint names the directory of the data path); `fsync`: sync every file before its rename."""

    def __init__(self, root: str, model: ModelBinding, fsync: bool) -> None:
        self.root = root
        self._model = model
        self.fsync = fsync

    def chunk_dir(self, key: str, fingerprint: str | None = None) -> str:
        if not _KEY.fullmatch(key):
            raise ValueError(f"invalid chunk key {key!r}")
        return f"{self.root}/{fingerprint or self._model.fingerprint}/{key[:2]}/{key}"  # f-string: hot path

    def object_path(self, key: str, layer: int | str) -> str:
        return f"{self.chunk_dir(key)}/{layer}.kv"

    def committed(self, chunk: str) -> bool:
        return os.path.exists(f"{chunk}/{MARKER}")

    def refresh(self, key: str) -> None:
        """A reader loaded chunk `key`'s layer 0: advance its LRU clock (as touch, without reading it back)."""
        now = time.time_ns()
        try:
            os.utime(f"{self.chunk_dir(key)}/{MARKER}", ns=(now, now))
        except OSError:  # not committed yet, or evicted: nothing to refresh
            pass

    def touch(self, marker: str) -> int:
        """Advance the chunk's LRU clock (explicit ns: coarse filesystem clocks would tie); returns it
        as the filesystem stored it (0 if the marker is gone)."""
        now = time.time_ns()
        try:
            os.utime(marker, ns=(now, now))
            return os.stat(marker).st_mtime_ns
        except OSError:  # not committed yet, or evicted: nothing to refresh
            return 0

    def write_atomic(self, directory: str, name: str, parts: tuple[Buffer, ...], create: bool = True) -> None:
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
                unlink_quietly(tmp)
                raise

    def remove_dir(self, path: str) -> bool:
        """Rename away (atomic disappearance), then delete; False if it was already gone."""
        parent, name = os.path.split(path)
        doomed = os.path.join(parent, f".evict-{name}-{uuid.uuid4().hex}")
        try:
            os.rename(path, doomed)
        except FileNotFoundError:
            return False
        shutil.rmtree(doomed, ignore_errors=True)
        return True

    def fingerprints(self, fingerprint: str | None) -> list[str]:
        if fingerprint is not None:
            return [fingerprint] if os.path.isdir(os.path.join(self.root, fingerprint)) else []
        return sorted(name for name in os.listdir(self.root) if _FP.fullmatch(name))

    def chunks(self, fingerprint: str | None) -> Iterator[tuple[str, str]]:
        """(fingerprint, chunk directory) of every chunk, committed or not."""
        for fp in self.fingerprints(fingerprint):
            fp_dir = os.path.join(self.root, fp)
            for prefix in list_visible(fp_dir):
                prefix_dir = os.path.join(fp_dir, prefix)
                for key in list_visible(prefix_dir):
                    yield fp, os.path.join(prefix_dir, key)


def age(path: str, now: float) -> float:
    """Seconds since `path` (a chunk directory: every put renames a file into it) last changed; 0 if gone."""
    try:
        return now - os.stat(path).st_mtime
    except FileNotFoundError:
        return 0.0


def list_visible(directory: str) -> list[str]:
    try:
        return [name for name in os.listdir(directory) if not name.startswith(".")]
    except (FileNotFoundError, NotADirectoryError):
        return []


def dir_bytes(path: str) -> int:
    try:
        with os.scandir(path) as entries:
            return sum(entry.stat().st_size for entry in entries if entry.is_file())
    except FileNotFoundError:
        return 0


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _write_all(fd: int, parts: tuple[Buffer, ...]) -> None:
    views = [v for v in (memoryview(p).cast("B") for p in parts) if v.nbytes]
    while views:
        views = advance(views, os.writev(fd, views))
