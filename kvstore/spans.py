"""A load's destination as a table of byte pieces, for reads that land straight in paged KV blocks.

`KVStore.get_layer_spans` takes, per stored object, the byte spans its payload fills in order.
As memoryviews that is some 30 views per object that every read re-walks in Python; a
`SpanTable` describes the same spans once, as (region, offset, nbytes) rows over a few writable
regions (one layer's paged KV cache, the reading thread's scratch memory), so a compiled reader
(`SpanReader`, kvstore/native_reader.py) can take a whole layer's objects in one call. `views()` gives
the memoryviews for every other reader. The table is bounds-checked against its regions when made,
so no piece can point outside them.
"""
from __future__ import annotations

import threading

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np


def advance(views: list[memoryview], n: int) -> list[memoryview]:
    """The views still to fill after the first n bytes of `views` were transferred (a short read or
    write continues from there)."""
    i = 0
    while i < len(views) and n >= views[i].nbytes:
        n -= views[i].nbytes
        i += 1
    views = views[i:]
    if views and n:
        views = [views[0][n:], *views[1:]]
    return views


def copy_into(src: memoryview, views: list[memoryview]) -> None:
    """The first bytes of `src` into the views, in order, as far as `src` goes."""
    offset = 0
    for view in views:
        step = min(view.nbytes, src.nbytes - offset)
        view[:step] = src[offset:offset + step]
        offset += step
        if offset == src.nbytes:
            return


def _check_regions(regions: list[memoryview]) -> None:
    if any(region.readonly or region.ndim != 1 or region.itemsize != 1 for region in regions):
        raise ValueError("span table regions must be writable flat byte memoryviews")


class SpanReader(Protocol):
    """Reads of one layer's objects from files or redis replies, one call per step
    (kvstore/native_reader.KVReadLibrary)."""

    def load(self, paths: list[str], desc: np.ndarray, first: np.ndarray, bases: np.ndarray, headers: np.ndarray,
             expect: bytes, gate: int) -> Any:
        """One layer's objects from files: opened, size-checked, read from the page cache only into headers
        and spans (inside the gate whose words are at `gate`), hashed, and headers and digests compared
        with `expect`: native_reader.Loaded (what is not plainly right comes back open)."""

    def hash(self, desc: np.ndarray, first: np.ndarray, bases: np.ndarray, headers: np.ndarray) -> np.ndarray:
        """digests[i]: the xxh3 of header i's bytes [0, object_format.SUMMED) and object i's spans, already filled."""

    def resp_get(self, fd: int, commands: list[bytes], desc: np.ndarray, first: np.ndarray, bases: np.ndarray,
                 headers: np.ndarray, gate: int, timeout_ms: int) -> Any:
        """Pipelined GETs (`commands`, packed) sent on socket `fd` and their replies received into headers
        and spans (the spans only inside the gate whose words are at `gate`) and hashed:
        native_reader.Replies."""

    def gate_close(self, gate: int) -> int:
        """Shut a gate's compiled writers out (kvstore.gate.WriteGate.native); how many are still inside."""


@dataclass
class SpanTable:
    """Object i's payload fills pieces desc[first[i]:first[i + 1]] in order; a piece is (region, byte
    offset, nbytes) in `regions` (writable byte memoryviews)."""

    regions: list[memoryview]
    desc: np.ndarray  # int64 [pieces, 3]
    first: np.ndarray  # int64 [objects + 1]
    totals: list[int] = field(init=False)  # payload bytes of each object
    extents: list[int] = field(init=False)  # per region: where its furthest piece ends

    def __post_init__(self) -> None:
        desc, first = self.desc, self.first
        if desc.dtype != np.int64 or desc.ndim != 2 or desc.shape[1] != 3 or not desc.flags.c_contiguous or \
                first.dtype != np.int64 or first.ndim != 1 or not first.flags.c_contiguous or len(first) < 1 or \
                first[0] != 0 or first[-1] != len(desc) or (np.diff(first) < 0).any():
            raise ValueError("a span table is int64 desc [pieces, 3] and first [objects + 1] from 0 to pieces")
        _check_regions(self.regions)
        self.extents = [0] * len(self.regions)
        if len(desc):
            where, offset, nbytes = desc[:, 0], desc[:, 1], desc[:, 2]
            if (where < 0).any() or (where >= len(self.regions)).any() or (offset < 0).any() or (nbytes < 0).any():
                raise ValueError("a span table piece lies outside its region")
            ends = np.zeros(len(self.regions), np.int64)
            np.maximum.at(ends, where, offset + nbytes)
            self.extents = ends.tolist()
        if any(extent > region.nbytes for extent, region in zip(self.extents, self.regions)):
            raise ValueError("a span table piece lies outside its region")
        sums = np.concatenate(([0], np.cumsum(desc[:, 2]))) if len(desc) else np.zeros(1, np.int64)
        self.totals = (sums[first[1:]] - sums[first[:-1]]).tolist()

    def with_regions(self, regions: list[memoryview]) -> SpanTable:
        """The same pieces over other regions (each at least as large as the pieces need), without
        walking the table again: a load's layers share one table (connectors/direct_rows.py)."""
        _check_regions(regions)
        if len(regions) != len(self.regions) or any(extent > region.nbytes
                                                    for extent, region in zip(self.extents, regions)):
            raise ValueError("a span table piece lies outside its region")
        table = object.__new__(SpanTable)  # no __post_init__: the pieces were checked once (copy.copy is slower)
        table.__dict__.update(self.__dict__)
        table.regions = list(regions)
        return table

    def __len__(self) -> int:
        return len(self.first) - 1

    def views(self) -> list[list[memoryview]]:
        regions = self.regions
        rows = self.desc.tolist()
        return [[regions[w][o:o + n] for w, o, n in rows[a:b]] for a, b in zip(self.first[:-1].tolist(),
                                                                             self.first[1:].tolist())]

    def bases(self) -> np.ndarray:
        """Each region's address (the regions must outlive the read)."""
        return np.array([np.frombuffer(region, np.uint8).ctypes.data for region in self.regions], np.uint64)


_SCRATCH = threading.local()


def scratch_table(sizes: list[int]) -> tuple[memoryview, SpanTable, list[int]]:
    """A span table of one piece per object (`sizes` bytes each, back to back) over this thread's scratch,
    for objects read whole before they are decoded (kvstore/coded_reads.py): (scratch, table, offsets with
    the end last). The scratch is grown as needed and kept: a layer's objects are decoded from it before
    the thread reads the next."""
    offsets = np.concatenate(([0], np.cumsum(sizes, dtype=np.int64)))
    nbytes = int(offsets[-1])
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.nbytes < nbytes:
        buf = _SCRATCH.buf = memoryview(np.empty(max(nbytes, 1), np.uint8)).cast("B")
    scratch = buf[:max(nbytes, 1)]
    desc = np.stack([np.zeros(len(sizes), np.int64), offsets[:-1], np.asarray(sizes, np.int64)], axis=1)
    table = SpanTable([scratch], np.ascontiguousarray(desc), np.arange(len(sizes) + 1, dtype=np.int64))
    return scratch, table, offsets.tolist()
