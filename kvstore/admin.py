"""Administration of a KV store across every model fingerprint (what the `pd-kvstore` CLI calls).

`StoreAdmin` is the administration member of kvstore.base.KVStore; each backend implements the hooks of
`ChunkInventory` (kvstore/filesystem.py, kvstore/redis_store.py).

Damage and healing. A committed chunk is damaged when its marker is empty or unreadable, a layer
object is missing, or an object fails its checks (header, key binding, checksum). Since a prefill
skips chunks already committed, a damaged chunk would never be rewritten: `repair(keys)` (the
connectors call it when a load fails on a damaged chunk) and `verify(repair=True)` un-commit it
(marker and layers vanish in one step), so the next prefill writes it again.
"""
from __future__ import annotations

import logging
from typing import Iterator, Protocol, Sequence

from pdserve.kvstore import object_format
from pdserve.kvstore.binding import ModelBinding
from pdserve.kvstore.calls import StoreCalls
from pdserve.kvstore.errors import CorruptObject, NotFound
from pdserve.kvstore.records import Buffer, ChunkInfo, Usage, VerifyReport

logger = logging.getLogger(__name__)


class ChunkInventory(Protocol):
    """The backend hooks administration calls: what the store holds, object by object and chunk by chunk."""

    def object_name(self, key: str, layer: int | str) -> str: ...

    def _get(self, items: list[tuple[int | str, str]]) -> list[Buffer]:
        """Raw object bytes of (layer name, key) items, in order; NotFound for a missing one."""

    def _chunk_infos(self, fingerprint: str | None) -> Iterator[ChunkInfo]: ...

    def _iter_objects(self, fingerprint: str | None) -> Iterator[tuple[str, str, int | str, str, Buffer]]:
        """(fingerprint, chunk key, layer, object name, raw bytes) of every stored layer object
        (key and layer as its name says: verify checks the object's binding against them)."""

    def _clear(self, fingerprint: str | None) -> int: ...

    def _committed_chunks(self, fingerprint: str | None) -> Iterator[tuple[str, str]]:
        """(fingerprint, chunk key) of every committed chunk."""

    def _damage(self, fingerprint: str, key: str) -> tuple[str | None, list[int | str]]:
        """(what is wrong with a committed chunk's marker or layer set, or None; the names of its layer objects,
        kvstore/layout.py). A chunk that is not committed (or gone) is (None, [])."""

    def _uncommit(self, fingerprint: str, key: str) -> bool:
        """Make a chunk vanish (marker and layers, the marker first or all at once); False if it was gone."""


class StoreAdmin:
    """list_chunks, inventory, verify, repair and clear of a store: over its `backend`'s chunks, through its
    `calls`; repair applies to the model of `model`."""

    def __init__(self, model: ModelBinding, backend: ChunkInventory, calls: StoreCalls) -> None:
        self._model = model
        self._backend = backend
        self._calls = calls

    def list_chunks(self, fingerprint: str | None = None) -> list[ChunkInfo]:
        """Every chunk (committed or not) of one or all fingerprints."""
        return self._calls.guard(lambda: list(self._backend._chunk_infos(fingerprint)))

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
        objects = self._backend._iter_objects(fingerprint)
        while (item := self._calls.guard(next, objects, None)) is not None:
            fp, key, layer, name, buf = item
            report.objects += 1
            report.bytes += len(memoryview(buf).cast("B"))
            try:
                object_format.decode(buf, fp, name=name, key=key, layer=layer)
            except CorruptObject as exc:
                report.corrupt.append(str(exc))
                bad[(fp, key)] = None
        chunks = self._backend._committed_chunks(fingerprint)
        while (chunk := self._calls.guard(next, chunks, None)) is not None:
            reason, _ = self._calls.guard(self._backend._damage, *chunk)
            if reason:
                report.damaged.append(f"{chunk[0]}/{chunk[1]}: {reason}")
                bad[chunk] = None
        if repair:
            report.repaired = sum(self._calls.guard(self._backend._uncommit, fp, key) for fp, key in bad)
        return report

    def repair(self, keys: Sequence[str]) -> int:
        """Un-commit the damaged chunks among `keys` (this store's fingerprint; every object of a structurally
        whole chunk is read and checked); returns how many. For a load that failed on a damaged chunk."""
        fingerprint, backend, guard = self._model.fingerprint, self._backend, self._calls.guard
        if fingerprint is None:
            raise ValueError("repair needs a store opened for a model fingerprint")
        repaired = 0
        for key in keys:
            reason, names = guard(backend._damage, fingerprint, key)
            for layer in (names if reason is None else []):
                try:
                    object_format.decode(guard(backend._get, [(layer, key)])[0], fingerprint,
                                         name=backend.object_name(key, layer), key=key, layer=layer)
                except (CorruptObject, NotFound) as exc:
                    reason = str(exc)
                    break
            if reason and guard(backend._uncommit, fingerprint, key):
                logger.warning("KV store: chunk %s was damaged (%s): un-committed, the next prefill rewrites it",
                               key, reason)
                repaired += 1
        return repaired

    def clear(self, fingerprint: str | None = None) -> int:
        """Delete every chunk of one or all fingerprints; returns the number of objects removed."""
        return self._calls.guard(self._backend._clear, fingerprint)
