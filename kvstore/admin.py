"""Administration of a KV store across every model fingerprint (what the `pd-kvstore` CLI calls).

`StoreAdmin` is mixed into kvstore.base.KVStore (its _lock, _stats and _guard); each backend
implements the hooks below.

Damage and healing. A committed chunk is damaged when its marker is empty or unreadable, a layer
object is missing, or an object fails its checks (header, key binding, checksum). Since a prefill
skips chunks already committed, a damaged chunk would never be rewritten: `repair(keys)` (the
connectors call it when a load fails on a damaged chunk) and `verify(repair=True)` un-commit it
(marker and layers vanish in one step), so the next prefill writes it again.
"""
from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from typing import Any, Iterator, Sequence

from pdserve.kvstore import object_format
from pdserve.kvstore.errors import CorruptObject, NotFound
from pdserve.kvstore.records import Buffer, ChunkInfo, StoreStats, Usage, VerifyReport

logger = logging.getLogger(__name__)


class StoreAdmin(ABC):
    """stats, list_chunks, inventory, verify and clear of a KVStore."""

    _lock: threading.Lock
    _stats: StoreStats
    fingerprint: str | None
    _guard: Any
    _get: Any
    object_name: Any

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
            u.raw_bytes += info.raw_bytes
            for name, nbytes in info.codec_bytes.items():
                u.codec_bytes[name] = u.codec_bytes.get(name, 0) + nbytes
            if info.committed:
                u.committed_bytes += info.bytes
            elif info.orphaned:
                u.orphaned_chunks += 1
                u.orphaned_bytes += info.bytes
            else:
                u.inflight_chunks += 1
                u.inflight_bytes += info.bytes
        return usage

    def verify(self, fingerprint: str | None = None, repair: bool = False) -> VerifyReport:
        """Re-check every object (header, fingerprint, key binding, checksum) and every committed chunk
        (marker, all layers present) of one or all fingerprints; with repair, un-commit the damaged chunks."""
        report = VerifyReport()
        bad: dict[tuple[str, str], None] = {}
        objects = self._iter_objects(fingerprint)
        while (item := self._guard(next, objects, None)) is not None:
            fp, key, layer, name, buf = item
            report.objects += 1
            report.bytes += len(memoryview(buf).cast("B"))
            try:
                object_format.decode(buf, fp, name=name, key=key, layer=layer)
            except CorruptObject as exc:
                report.corrupt.append(str(exc))
                bad[(fp, key)] = None
        chunks = self._committed_chunks(fingerprint)
        while (chunk := self._guard(next, chunks, None)) is not None:
            reason, _ = self._guard(self._damage, *chunk)
            if reason:
                report.damaged.append(f"{chunk[0]}/{chunk[1]}: {reason}")
                bad[chunk] = None
        if repair:
            report.repaired = sum(self._guard(self._uncommit, fp, key) for fp, key in bad)
        return report

    def repair(self, keys: Sequence[str]) -> int:
        """Un-commit the damaged chunks among `keys` (this store's fingerprint; every object of a structurally
        whole chunk is read and checked); returns how many. For a load that failed on a damaged chunk."""
        if self.fingerprint is None:
            raise ValueError("repair needs a store opened for a model fingerprint")
        repaired = 0
        for key in keys:
            reason, names = self._guard(self._damage, self.fingerprint, key)
            for layer in (names if reason is None else []):
                try:
                    object_format.decode(self._guard(self._get, [(layer, key)])[0], self.fingerprint,
                                 name=self.object_name(key, layer), key=key, layer=layer)
                except (CorruptObject, NotFound) as exc:
                    reason = str(exc)
                    break
            if reason and self._guard(self._uncommit, self.fingerprint, key):
                logger.warning("KV store: chunk %s was damaged (%s): un-committed, the next prefill rewrites it",
                               key, reason)
                repaired += 1
        return repaired

    def clear(self, fingerprint: str | None = None) -> int:
        """Delete every chunk of one or all fingerprints; returns the number of objects removed."""
        return self._guard(self._clear, fingerprint)

    @abstractmethod
    def _chunk_infos(self, fingerprint: str | None) -> Iterator[ChunkInfo]: ...

    @abstractmethod
    def _iter_objects(self, fingerprint: str | None) -> Iterator[tuple[str, str, int | str, str, Buffer]]:
        """(fingerprint, chunk key, layer, object name, raw bytes) of every stored layer object
        (key and layer as its name says: verify checks the object's binding against them)."""

    @abstractmethod
    def _clear(self, fingerprint: str | None) -> int: ...

    @abstractmethod
    def _committed_chunks(self, fingerprint: str | None) -> Iterator[tuple[str, str]]:
        """(fingerprint, chunk key) of every committed chunk."""

    @abstractmethod
    def _damage(self, fingerprint: str, key: str) -> tuple[str | None, list[int | str]]:
        """(what is wrong with a committed chunk's marker or layer set, or None; the names of its layer objects,
        kvstore/layout.py). A chunk that is not committed (or gone) is (None, [])."""

    @abstractmethod
    def _uncommit(self, fingerprint: str, key: str) -> bool:
        """Make a chunk vanish (marker and layers, the marker first or all at once); False if it was gone."""
