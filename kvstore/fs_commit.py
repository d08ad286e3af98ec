"""A file store's commit markers and its commit rule: what makes a chunk visible, and what it records.

A chunk directory's `commit` marker appears (renamed into place) only after every layer object of the
chunk is written; it records the chunk's object bytes (the ledger's size, kvstore/fs_ledger.py) and, when
the writer was not one plain raw part, its layout (kvstore/layout.py: head groups, parts, codec, heads
per object). A multi-part writer (TP/PP ranks) first leaves `commit.<part>` for its own part; whichever
writer finds every part's marker there writes the chunk's. Lookups read the markers in order and keep
their layouts for the load that follows. `FileCommits` is the commits member of
kvstore.filesystem.FileSystemStore.
"""
from __future__ import annotations

import os
import struct
from typing import Callable

from pdserve.kvstore.binding import ModelBinding
from pdserve.kvstore.errors import NotFound, StoreUnavailable
from pdserve.kvstore.fs_ledger import Entry
from pdserve.kvstore.fs_tree import MARKER, ChunkTree
from pdserve.kvstore.layout import WriterLayout

MARKER_FORMAT = struct.Struct("<4sHIQ")  # magic, version, num_layers, bytes of the chunk's layer objects
_MARKER_MAGIC = b"PDKC"
MARKER_MAX = 4096  # a marker's bytes at most (a version-2 marker's layout text is far shorter)


class FileCommits:
    """Lookups, layouts and commits of the chunks in `tree` (of the model of `model`); `committed(keys,
    entries)` hears of every commit: the keys no longer in flight, and the (fingerprint/key, bytes, LRU
    clock) of the chunks made visible (kvstore/fs_space.py, SpaceKeeper.committed)."""

    def __init__(self, tree: ChunkTree, model: ModelBinding,
                 committed: Callable[[list[str], list[Entry]], None]) -> None:
        self._tree = tree
        self._model = model
        self._committed = committed

    def lookup(self, keys: list[str]) -> list[tuple[str, WriterLayout | None]]:
        found: list[tuple[str, WriterLayout | None]] = []
        for key in keys:
            try:
                layout = self._model.admit(read_marker(f"{self._tree.chunk_dir(key)}/{MARKER}"))
            except FileNotFoundError:
                if not os.path.isdir(self._tree.root):  # deleted or unmounted: an outage, not a miss
                    raise StoreUnavailable(f"{self._tree.root}: the store directory is gone") from None
                break
            found.append((key, layout))  # an unreadable marker (None) still counts: the load fails, repair heals
        return found

    def read_layouts(self, keys: list[str]) -> list[WriterLayout]:
        layouts = []
        for key in keys:
            path = f"{self._tree.chunk_dir(key)}/{MARKER}"
            try:
                layout = read_marker(path)
            except FileNotFoundError:
                raise NotFound(f"{path}: chunk {key} is not committed") from None
            layouts.append(self._model.trusted(layout, path))
        return layouts

    def commit(self, keys: list[str], layout: WriterLayout, part: int) -> None:
        incomplete, committed = [], []
        kv_shape = self._model.kv_shape
        heads = layout.num_kv_heads or (kv_shape[0] if kv_shape else 0)
        names = [f"{name}.kv" for name in layout.object_layers(heads)]
        if not layout.single:
            own = [f"{name}.kv" for name in layout.part_objects(part, heads)]
            parts = layout.part_names(heads)
        for key in keys:
            chunk = self._tree.chunk_dir(key)
            try:
                if layout.single:
                    size = sum(os.stat(os.path.join(chunk, name)).st_size for name in names)
                else:  # this writer's part, then the chunk once every part's marker is there
                    for name in own:
                        os.stat(os.path.join(chunk, name))
                    self._tree.write_atomic(chunk, f"{MARKER}.{parts[part]}", (b"",), create=False)
                    if not all(os.path.exists(f"{chunk}/{MARKER}.{name}") for name in parts):
                        continue  # another writer's part is still on its way: that writer commits the chunk
                    size = sum(os.stat(os.path.join(chunk, name)).st_size for name in names)
            except FileNotFoundError:
                incomplete.append(key)
                continue
            try:  # no directory re-creation here: a marker must never appear in an evicted, empty chunk
                self._tree.write_atomic(chunk, MARKER, (make_marker(layout, size),), create=False)
                clock = self._tree.touch(os.path.join(chunk, MARKER))
            except FileNotFoundError:
                incomplete.append(key)
                continue
            committed.append((f"{self._model.fingerprint}/{key}", size, clock))
        self._committed([key for key in keys if key not in incomplete], committed)
        if incomplete:
            raise NotFound(f"{len(incomplete)} chunk(s) miss layers and stay invisible: {incomplete[0]}...")


def make_marker(layout: WriterLayout, size: int) -> bytes:
    """A commit marker: magic, version, layer count, the chunk's object bytes; version 2 adds the writer's
    layout (kvstore/layout.py) after them. The plain layout (one part, raw) writes version 1, as before."""
    if layout.plain:
        return MARKER_FORMAT.pack(_MARKER_MAGIC, 1, layout.num_layers, size)
    return MARKER_FORMAT.pack(_MARKER_MAGIC, 2, layout.num_layers, size) + layout.encode().encode()


def parse_marker(raw: bytes) -> WriterLayout | None:
    """The layout a commit marker records; None for anything that is not a whole marker."""
    if len(raw) < MARKER_FORMAT.size or len(raw) > MARKER_MAX or raw[:4] != _MARKER_MAGIC:
        return None
    _, version, layers, _ = MARKER_FORMAT.unpack_from(raw)
    try:
        if version == 1 and len(raw) == MARKER_FORMAT.size and layers >= 1:
            return WriterLayout(layers)
        if version == 2:
            layout = WriterLayout.decode(raw[MARKER_FORMAT.size:].decode("ascii"))
            return layout if layout.num_layers == layers and not layout.plain else None
    except (ValueError, UnicodeDecodeError):
        return None
    return None


def read_marker(path: str) -> WriterLayout | None:
    with open(path, "rb") as f:
        return parse_marker(f.read(MARKER_MAX + 1))


def marker_bytes(marker: str) -> int:
    with open(marker, "rb") as f:
        raw = f.read(MARKER_FORMAT.size)
    if len(raw) != MARKER_FORMAT.size or raw[:4] != _MARKER_MAGIC:
        return 0
    return MARKER_FORMAT.unpack(raw)[3]
