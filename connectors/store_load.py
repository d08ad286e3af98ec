"""One store load in flight, and this rank's paged KV caches as every kind of store read writes into them.

`StoreLoad` is the store connector's InFlightLoad: its chunk keys and sizes, what the store's commit
markers said of them (layouts, codecs), and how its rows reach paged memory. `PagedCaches` owns that
last part for every read path alike (the raw read in connectors/store_connector.py, the decoded ones in
connectors/decoded_loads.py): straight into the blocks when the caches are host memory of the stored
layout (connectors/direct_rows.py), else through the transfer's staging buffer and one scatter per
layer (connectors/staging.py).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pdserve.connectors import direct_rows
from pdserve.connectors.chunked import InFlightLoad
from pdserve.connectors.direct_rows import DirectRows
from pdserve.kvstore.native_reader import native_reader

if TYPE_CHECKING:
    from pdserve.connectors.staging import BlockScatter, DirectTransfer, ReadTarget
    from pdserve.kvstore.layout import WriterLayout
    from pdserve.kvstore.native_reader import KVReadLibrary
    from pdserve.kvstore.spans import SpanTable


@dataclass
class StoreLoad(InFlightLoad):
    keys: list[str] = field(default_factory=list)
    chunk_lens: list[int] = field(default_factory=list)  # tokens of each chunk read
    slots: torch.Tensor | None = None  # spec.slots on the engine's device
    scatter: BlockScatter | None = None  # the transfer's plan of the scatter into `slots` (the same for every layer)
    direct: DirectRows | None = None  # reads straight into the blocks: where each byte goes (every layer)
    events: dict[int, Any] = field(default_factory=dict)  # layer -> the event of its copy into paged memory
    layouts: list[WriterLayout] | None = None  # each chunk's writer layout (read once, by the first layer read)
    layouts_lock: threading.Lock = field(default_factory=threading.Lock)
    whole: bool = True  # every chunk has an object of exactly this rank's heads (known once layouts are)
    coded: bool = False  # some chunk was written with a codec (known once layouts are)
    codecs: set[str] = field(default_factory=set)  # the codecs of the objects read, when not all raw
    # another layout's chunks: the reads of every layer (DecodedLoads.read_parts plans them once)
    parts_plan: list[tuple[tuple[int, int], list[str], list[int], list[str], SpanTable]] | None = None


class PagedCaches:
    """This rank's paged KV caches (indexed by the model's layer index), and where a load's rows land in them."""

    def __init__(self, transfer: DirectTransfer, block_size: int, dtype: torch.dtype,
                 kv_shape: tuple[int, int]) -> None:
        self.transfer = transfer
        self.block_size = block_size
        self.dtype = dtype
        self.kv_shape = kv_shape  # this rank's (KV heads, head dim): a staging buffer's rows
        self.kv_caches: list[torch.Tensor | None] = []
        self._cache_bytes: list[memoryview | None] = []  # per layer, when loads read straight into the blocks
        self._row_bytes = self._half_bytes = 0  # the blocks' layout, when loads read straight into them
        self._planner: KVReadLibrary | None = None  # DirectRows' plan in C
        self._local = threading.local()  # per I/O thread: scratch memory of direct reads

    def register(self, kv_caches: list[torch.Tensor | None], own: range) -> None:
        """The caches by layer index (None before this rank's first layer); `own`: the layers it loads."""
        self.kv_caches = kv_caches
        # Store reads land straight in the blocks when the caches are host memory of the stored layout
        # (no staging copy); otherwise (CUDA, another layout) through the transfer's staging buffers.
        caches = [kv_caches[layer] for layer in own]
        direct = self.transfer.reads_in_place and all(direct_rows.applies_to(c, self.dtype, self.block_size)
                                                      for c in caches)
        self._cache_bytes = [None if c is None else direct_rows.cache_bytes(c) for c in kv_caches] \
            if direct else []
        if direct:
            cache = caches[0]
            self._row_bytes = cache[0, 0, 0].numel() * cache.element_size()  # one token's K (or V) row
            self._half_bytes = cache[0].numel() * cache.element_size()  # one layer's K half
            self._planner = native_reader()  # DirectRows' plan in C (None: in numpy)

    def prepare(self, load: StoreLoad) -> None:
        """Plan how the load's rows reach the blocks (compute thread, once per load: every layer has the same
        slots): a direct read's span plan when its chunks are whole objects of this rank's heads, and the
        staged scatter whenever a read may need it (the layouts are not known yet, or they are another's)."""
        spec, plan = load.spec, load.spec.plan
        if self._cache_bytes and load.whole:
            lo, hi = (at - plan.aligned_start for at in plan.write_range)
            load.direct = DirectRows.plan(spec.slots, load.chunk_lens, lo, hi, self._row_bytes, self._half_bytes,
                                          self._planner)
        if not self._cache_bytes or load.layouts is None or not load.whole:
            load.slots = self.transfer.device_slots(spec.slots)
            load.scatter = self.transfer.scatter_plan(spec.slots, self.block_size)

    def direct_spans(self, load: StoreLoad, layer: int) -> SpanTable:
        """Where a direct read of one layer puts each byte (`load.direct` is set): the blocks, and this I/O
        thread's scratch."""
        return load.direct.spans(self._cache_bytes[layer], self._scratch(load.direct.scratch_bytes))

    def read_target(self, load: StoreLoad) -> ReadTarget:
        """A staging buffer for one layer of the load's chunks (this rank's heads)."""
        return self.transfer.read_target(load.chunk_lens, self.kv_shape, self.dtype)

    def hand_back(self, load: StoreLoad, layer: int, target: ReadTarget) -> None:
        """A staged read failed: the buffer goes back to the pool, nothing is written."""
        self.transfer.load(self.kv_caches[layer], 0, 0, load.slots, target)

    def scatter(self, load: StoreLoad, layer: int, target: ReadTarget) -> None:
        """Write the rows of tokens [N, N + need) of a staged layer into their slots (under the load's lock:
        nothing once the load failed) and keep the copy's event."""
        plan = load.spec.plan
        first = plan.aligned_start
        write_start, write_end = plan.write_range
        with load.lock:
            lo, hi = (0, 0) if load.failed else (write_start - first, write_end - first)
            load.events[layer] = self.transfer.load(self.kv_caches[layer], lo, hi, load.slots, target,
                                                    load.scatter)
            load.finished = max(load.finished, time.perf_counter())

    def _scratch(self, nbytes: int) -> memoryview:
        """This I/O thread's scratch memory for the rows a direct read must not put in the blocks."""
        buf = getattr(self._local, "scratch", None)
        if buf is None or buf.nbytes < nbytes:
            buf = self._local.scratch = memoryview(bytearray(max(nbytes, 1 << 16)))
        return buf
