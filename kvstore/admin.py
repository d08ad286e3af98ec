"""Administration of a KV store across every model fingerprint (what the `pd-kvstore` CLI calls).

`StoreAdmin` is mixed into kvstore.base.KVStore (its _lock, _stats and _guard); each backend
implements the three hooks below.
"""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from typing import Iterator

from pdserve.kvstore import codec
from pdserve.kvstore.errors import CorruptObject
from pdserve.kvstore.records import Buffer, ChunkInfo, StoreStats, Usage, VerifyReport


class StoreAdmin(ABC):
    """stats, list_chunks, inventory, verify and clear of a KVStore."""

    _lock: threading.Lock
    _stats: StoreStats

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
            if info.committed:
                u.committed_bytes += info.bytes
            elif info.orphaned:
                u.orphaned_chunks += 1
                u.orphaned_bytes += info.bytes
            else:
                u.inflight_chunks += 1
                u.inflight_bytes += info.bytes
        return usage

    def verify(self, fingerprint: str | None = None) -> VerifyReport:
        """Re-check every object (header, fingerprint, key binding, checksum) of one or all fingerprints."""
        report = VerifyReport()
        objects = self._iter_objects(fingerprint)
        while (item := self._guard(next, objects, None)) is not None:
            fp, key, layer, name, buf = item
            report.objects += 1
            report.bytes += len(memoryview(buf).cast("B"))
            try:
                codec.decode(buf, fp, name=name, key=key, layer=layer)
            except CorruptObject as exc:
                report.corrupt.append(str(exc))
        return report

    def clear(self, fingerprint: str | None = None) -> int:
        """Delete every chunk of one or all fingerprints; returns the number of objects removed."""
        return self._guard(self._clear, fingerprint)

    @abstractmethod
    def _chunk_infos(self, fingerprint: str | None) -> Iterator[ChunkInfo]: ...

    @abstractmethod
    def _iter_objects(self, fingerprint: str | None) -> Iterator[tuple[str, str, int, str, Buffer]]:
        """(fingerprint, chunk key, layer, object name, raw bytes) of every stored layer object
        (key and layer as its name says: verify checks the object's binding against them)."""

    @abstractmethod
    def _clear(self, fingerprint: str | None) -> int: ...
