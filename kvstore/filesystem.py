"""file:///path backend: one directory tree shared by every node (local disk or NFS).

Layout: <root>/<fingerprint>/<key[:2]>/<key>/<layer>.kv plus <key>/commit, the marker that
makes the chunk visible; written and removed in atomic steps (kvstore/fs_tree.py, ChunkTree).

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

The store holds its collaborators as members: the tree (`_tree`, kvstore/fs_tree.py), its reads
(`_files`, kvstore/fs_read.py: whole objects, and loads straight into paged KV blocks through their
write gate), its commit markers and the commit rule (`_commits`, kvstore/fs_commit.py), and the bound
with its ledger, eviction and failed-save cleanup (`_space`, kvstore/fs_space.py). This module keeps the
writes, deletes and the administration hooks.
"""
from __future__ import annotations

import errno
import os
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from pdserve.kvstore import fs_ledger, fs_space, object_format, payload_codecs
from pdserve.kvstore.base import KVStore
from pdserve.kvstore.errors import NotFound, StoreError, StoreTimeout, StoreUnavailable
from pdserve.kvstore.fs_commit import MARKER_FORMAT, MARKER_MAX, FileCommits, parse_marker
from pdserve.kvstore.fs_read import FileReader, read_file
from pdserve.kvstore.fs_space import ORPHAN_GRACE_S, SpaceKeeper
from pdserve.kvstore.fs_tree import MARKER, ChunkTree, age, list_visible, unlink_quietly
from pdserve.kvstore.gate import NO_GATE, WriteGate
from pdserve.kvstore.layout import WriterLayout, parse_object_layer
from pdserve.kvstore.records import Buffer, ChunkInfo
from pdserve.kvstore.spans import SpanTable


class FileSystemStore(KVStore):
    def __init__(self, root: str | os.PathLike, *, max_bytes: int | None = None, fsync: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.root = Path(root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreUnavailable(f"cannot use {self.root} as a KV store: {exc.strerror}") from exc
        if not os.access(self.root, os.R_OK | os.W_OK | os.X_OK):
            raise StoreUnavailable(f"cannot use {self.root} as a KV store: permission denied")
        self.default_bound = max_bytes is None  # the nodes log which bound a store got (bounds_note)
        bound = fs_space.default_max_bytes(str(self.root)) if max_bytes is None else (max_bytes or None)
        self._tree = ChunkTree(str(self.root), self._model, fsync)
        self._files = FileReader(self._tree, self._model, self._span_readers)
        self._space = SpaceKeeper(self._tree, self._model, bound)
        self._commits = FileCommits(self._tree, self._model, self._space.committed)

    @property
    def max_bytes(self) -> int | None:
        """The bound on the bytes of layer objects under the root (None: unbounded; kvstore/fs_space.py)."""
        return self._space.max_bytes

    @property
    def fsync(self) -> bool:
        return self._tree.fsync

    @property
    def sweep_after_s(self) -> float:
        """How long a failed save's chunk stays quiet before the sweep removes it (kvstore/fs_space.py)."""
        return self._space.sweep_after_s

    @sweep_after_s.setter
    def sweep_after_s(self, seconds: float) -> None:
        self._space.sweep_after_s = seconds

    def object_name(self, key: str, layer: int | str) -> str:
        return self._tree.object_path(key, layer)

    def reconcile(self) -> tuple[int, int]:
        """Walk the tree and fix the max_bytes ledger against it (kvstore/fs_space.py); (added, dropped)."""
        return self._space.reconcile()

    def bounds_warning(self) -> str | None:
        if self.max_bytes:
            return None
        return f"KV store {self.root} is unbounded (max_bytes=0): it grows until its disk is full"

    def capacity_warning(self, chunk_tokens: int, prompt_tokens: int) -> str | None:
        return fs_space.capacity_warning(str(self.root), self.max_bytes, self.default_bound,
                                         self._model.chunk_bytes(chunk_tokens, self.codec),
                                         self.codec != payload_codecs.LOSSLESS, chunk_tokens, prompt_tokens)

    def bounds_note(self) -> str | None:
        if not self.max_bytes:
            return None
        how = (f"the default: the smaller of {fs_space.DEFAULT_CAP_BYTES / 2**30:g} GiB and "
               f"{fs_space.DEFAULT_FRACTION:.0%} of its {fs_space.filesystem_bytes(str(self.root)) / 2**30:.1f} GiB "
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
        self._space.make_room(sum(sizes))
        try:
            for (key, header, payload), size in zip(objects, sizes):
                self._tree.write_atomic(self._tree.chunk_dir(key), f"{layer}.kv", (header, *payload))
                self._space.inflight.add(key, size)
        except OSError as exc:
            self._space.save_failed([key for key, _, _ in objects], exc, sum(sizes))
            raise

    def _get(self, items: list[tuple[int | str, str]]) -> list[Buffer]:
        return self._files.get_objects(items)

    def _get_spans(self, items: list[tuple[int | str, str]], spans: list[list[memoryview]],
                   shapes: list[tuple[int, ...]], dtype: torch.dtype, gate: WriteGate = NO_GATE) -> None:
        self._files.get_spans(items, spans, shapes, dtype, gate)

    def _get_table(self, items: list[tuple[int | str, str]], table: SpanTable, shapes: list[tuple[int, ...]],
                   dtype: torch.dtype, gate: WriteGate) -> None:
        self._files.get_table(items, table, shapes, dtype, gate)

    def _get_whole(self, items: list[tuple[int | str, str]], sizes: list[int], expect: bytes
                   ) -> tuple[list[memoryview], memoryview, list[int]] | None:
        return self._files.get_whole(items, sizes, expect)

    def _lookup(self, keys: list[str]) -> list[tuple[str, WriterLayout | None]]:
        return self._commits.lookup(keys)

    def _read_layouts(self, keys: list[str]) -> list[WriterLayout]:
        return self._commits.read_layouts(keys)

    def _commit(self, keys: list[str], layout: WriterLayout, part: int) -> None:
        self._commits.commit(keys, layout, part)

    def _delete(self, keys: list[str]) -> int:
        removed = sum(self._tree.remove_dir(self._tree.chunk_dir(key)) for key in keys)
        self._space.forget([f"{self.fingerprint}/{key}" for key in keys])
        return removed

    def _chunk_infos(self, fingerprint: str | None) -> Iterator[ChunkInfo]:
        now = time.time()
        for fp, chunk in self._tree.chunks(fingerprint):
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
        for fp, chunk in self._tree.chunks(fingerprint):
            key = os.path.basename(chunk)
            for name in sorted(list_visible(chunk)):
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
        for fp in self._tree.fingerprints(fingerprint):
            self._tree.remove_dir(os.path.join(self.root, fp))
        for name in (fs_ledger.LEDGER, fs_ledger.WALKED):  # bounded stores rebuild the ledger with one walk
            unlink_quietly(os.path.join(self.root, name))
        return removed

    def _committed_chunks(self, fingerprint: str | None) -> Iterator[tuple[str, str]]:
        for fp, chunk in self._tree.chunks(fingerprint):
            if self._tree.committed(chunk):
                yield fp, os.path.basename(chunk)

    def _damage(self, fingerprint: str, key: str) -> tuple[str | None, list[int | str]]:
        chunk = self._tree.chunk_dir(key, fingerprint)
        try:
            with open(f"{chunk}/{MARKER}", "rb") as f:
                raw = f.read(MARKER_MAX + 1)
        except FileNotFoundError:
            return None, []
        if not raw:
            return "empty commit marker", []
        layout = parse_marker(raw)  # a layout (WriterLayout) holds at most MAX_CHUNK_OBJECTS objects
        reason = "corrupted commit marker" if layout is None else self._model.layout_damage(layout)
        if reason is not None:
            return reason, []
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
        # marker and layers vanish in one rename
        removed = self._tree.remove_dir(self._tree.chunk_dir(key, fingerprint))
        self._space.forget([f"{fingerprint}/{key}"])
        return removed

    def _close(self) -> None:
        self._space.close()


def _head(path: str) -> bytes:
    """An object's header bytes (b"" when it vanished meanwhile)."""
    try:
        with open(path, "rb") as f:
            return f.read(object_format.HEADER_SIZE)
    except FileNotFoundError:
        return b""
