"""The store connector's loads of chunks that are not one raw object of exactly this rank's heads: decoded.

Two ways, both ending as any load does (rows [N, N + need) into their slots, connectors/staging.py):

- **coded, this rank's heads** (a chunk written with `?codec=int8|fp8|lossless`, or a mix of coded and raw
  chunks, by a writer of this rank's head split): the layer's objects in one batched read, checked, and
  decoded in one C call (kvstore/coded_reads.py) straight into the blocks where raw loads read into them
  (connectors/direct_rows.py: the same span table), else into the staging buffer that is then scattered
  (both by connectors/store_load.PagedCaches, as for raw loads).
- **another layout** (a writer of another TP split, or one that split its heads into several objects:
  the store's `heads_per_object`): per object group that overlaps this rank's heads, the same batched read
  and C decode, row by row into this rank's heads of one staging buffer (`ReadTarget.heads_table`; heads
  it does not keep into scratch). An object holding heads this rank does not keep moves bytes for
  nothing: the first such load of a process says so in one warning, with the heads_per_object that
  would spare it.

connectors/store_connector.StoreConnector holds one `DecodedLoads` and hands it the layers its raw read
does not take.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from pdserve.kvstore.gate import NO_GATE

if TYPE_CHECKING:
    from pdserve.connectors.staging import ReadTarget
    from pdserve.connectors.store_load import PagedCaches, StoreLoad
    from pdserve.kvstore import KVStore
    from pdserve.kvstore.layout import WriterLayout
    from pdserve.kvstore.spans import SpanTable

logger = logging.getLogger(__name__)
_WIDE_READS = threading.Event()  # set once this process said that its loads read heads they do not keep
_WIDE_READS_LOCK = threading.Lock()


class DecodedLoads:
    """Layer reads of a load through the store's batched coded read, into one rank's heads of `paged_caches`."""

    def __init__(self, store: KVStore, paged_caches: PagedCaches, heads: tuple[int, int],
                 num_kv_heads: int) -> None:
        self.store = store
        self.paged_caches = paged_caches
        self.heads = heads  # this rank's KV heads [start, end) of the model's num_kv_heads
        self.num_kv_heads = num_kv_heads

    def read_coded(self, load: StoreLoad, layer: int) -> int:
        """One layer of chunks of this rank's heads, some of them coded: one batched read and one decode of
        the whole layer; the bytes read (as stored)."""
        if load.direct is not None:  # straight into the blocks, only inside the load's gate
            spans = self.paged_caches.direct_spans(load, layer)
            nbytes, codecs = self.store.get_layer_coded(layer, load.keys, spans, load.chunk_lens, load.gate,
                                                        heads=self.heads, codecs=_marker_codecs(load))
            with load.lock:
                load.codecs |= codecs
                load.finished = max(load.finished, time.perf_counter())
            return nbytes
        target = self.paged_caches.read_target(load)
        try:  # the staging buffer is this thread's until the scatter: no gate
            nbytes, codecs = self.store.get_layer_coded(layer, load.keys, target.span_table(), load.chunk_lens,
                                                        NO_GATE, heads=self.heads, codecs=_marker_codecs(load))
        except BaseException:
            self.paged_caches.hand_back(load, layer, target)
            raise
        with load.lock:
            load.codecs |= codecs
        self.paged_caches.scatter(load, layer, target)
        return nbytes

    def read_parts(self, load: StoreLoad, layer: int) -> int:
        """One layer of chunks written by another layout (or split into several objects per head group): per
        object group that overlaps this rank's heads, its chunks' objects read and checked as one batched
        coded read (kvstore/coded_reads.py) and decoded row by row into this rank's heads of one staging
        buffer (heads it does not keep into scratch), then scattered as any other load. The bytes read (as
        stored: encoded)."""
        target = self.paged_caches.read_target(load)
        nbytes = 0
        try:
            if load.parts_plan is None:  # the same reads for every layer of the load
                load.parts_plan = self._parts_plan(load, target)
            for group, keys, chunk_lens, codecs, table in load.parts_plan:
                stored, seen = self.store.get_layer_coded(layer, keys, target.retarget(table), chunk_lens, NO_GATE,
                                                          heads=group, codecs=codecs)
                nbytes += stored
                with load.lock:
                    load.codecs |= seen
        except BaseException:
            self.paged_caches.hand_back(load, layer, target)
            raise
        self.paged_caches.scatter(load, layer, target)
        return nbytes

    def _parts_plan(self, load: StoreLoad, target: ReadTarget) -> list[tuple[tuple[int, int], list[str], list[int],
                                                                             list[str], SpanTable]]:
        """Per object group overlapping this rank's heads: (group, its chunks' keys, their token counts, their
        marker codecs, the pieces its rows fill: ReadTarget.heads_table)."""
        by_group: dict[tuple[int, int], list[int]] = {}
        for j, layout in enumerate(load.layouts or []):
            reads = layout.reads(self.heads, self.num_kv_heads)
            for group, _ in reads:
                by_group.setdefault(group, []).append(j)
            if not _WIDE_READS.is_set() and (reads[0][0][0] < self.heads[0] or reads[-1][0][1] > self.heads[1]):
                _warn_wide_reads(layout, reads, self.heads, self.num_kv_heads)
        return [(group, [load.keys[j] for j in chunks], [load.chunk_lens[j] for j in chunks],
                 [load.layouts[j].codec for j in chunks], target.heads_table(chunks, group, self.heads))
                for group, chunks in by_group.items()]


def _warn_wide_reads(layout: WriterLayout, reads: list[tuple[tuple[int, int], tuple[int, int]]],
                     heads: tuple[int, int], num_kv_heads: int) -> None:
    """Once per process: this rank's loads read objects holding heads it does not keep, how many times the
    bytes it keeps they move, and the writer's heads_per_object that would make them read only its own."""
    with _WIDE_READS_LOCK:
        if _WIDE_READS.is_set():
            return
        _WIDE_READS.set()
    lo, hi = reads[0][0][0], reads[-1][0][1]
    logger.warning("KV store objects hold KV heads [%d, %d) of %d where this rank keeps [%d, %d): loads move %.1fx "
                   "the bytes they keep; store with heads_per_object=%d on the writer", lo, hi, num_kv_heads,
                   heads[0], heads[1], (hi - lo) / (heads[1] - heads[0]),
                   layout.fitting_object_heads(heads, num_kv_heads))


def _marker_codecs(load: StoreLoad) -> list[str] | None:
    """Each chunk's codec as its commit marker says (the objects' sizes follow from it for 8-bit and raw)."""
    return [layout.codec for layout in load.layouts] if load.layouts is not None else None
