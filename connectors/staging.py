"""How KV bytes move between a store's host tensors and paged device memory (docs/architecture.md, §7).

Two ways, one interface (`DirectTransfer`'s: `StagedTransfer` overrides every step), picked by
`make_kv_transfer` from the engine's device:

- `DirectTransfer` (CPU): a store read of one layer of a request's chunks lands in one reusable host
  buffer [2, T, H, D] (`PinnedPool`, plain memory on CPU; each chunk in its token slice: no
  allocation or page faults per load), and one scatter per layer writes the needed rows into
  their slots, a whole paged block per copy (`BlockScatter`, planned once per load: every layer
  has the same slots); saves gather each chunk into its own contiguous tensor. Nothing is
  asynchronous.
- `StagedTransfer` (CUDA): a store read of one layer of a request's chunks lands in one reusable
  pinned host buffer [2, T, H, D] (`PinnedPool`; each chunk in its token slice); a dedicated
  copy stream moves it to the device in one copy and scatters the needed rows into their slots
  in one launch, and one event per (load, layer) lets layer i's attention wait on the GPU, not
  on a host thread. Saves
  gather a layer's chunks on the compute stream, then a side stream copies them into pinned
  buffers; the store put (on the I/O pool) waits for that copy's event only. The copy stream
  first waits for the compute stream, so a block freed by an earlier step is overwritten only
  after every kernel that read it (an earlier save's gather included) has run.

StagedTransfer is plain torch code: on the CPU its copies are synchronous memcpys and its
events no-ops, which is how the CPU test suite checks it.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pdserve import kernels
from pdserve.kvstore.spans import SpanTable
if TYPE_CHECKING:
    from pdserve.engine.device import Platform  # the engine's device calls (the engine passes it in)

logger = logging.getLogger(__name__)

_MIN_PINNED_BYTES = 1 << 20


class PinnedPool:
    """Reusable host buffers (page-locked on CUDA). A released buffer carries the event of the device work
    still reading or writing it, and is handed out again only after that event completed."""

    def __init__(self, platform: Platform) -> None:
        self.platform = platform
        self._free: list[tuple[torch.Tensor, Any]] = []  # (uint8 buffer, event or None), smallest first
        self._lock = threading.Lock()
        self.allocated_bytes = 0
        self.num_allocations = 0
        self.num_acquired = 0

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of at least nbytes (sizes are powers of two from 1 MiB, so few distinct ones)."""
        with self._lock:
            self.num_acquired += 1
            for i, (buf, _) in enumerate(self._free):
                if buf.numel() >= nbytes:
                    buf, event = self._free.pop(i)
                    break
            else:
                buf, event = None, None
        if event is not None:
            event.synchronize()  # the copy that last used it has finished
        if buf is None:
            size = max(_MIN_PINNED_BYTES, 1 << (max(nbytes, 1) - 1).bit_length())
            buf = self.platform.pinned_empty(size, torch.uint8)
            with self._lock:
                self.allocated_bytes += size
                self.num_allocations += 1
            logger.debug("pinned staging pool grew by %d bytes to %d bytes", size, self.allocated_bytes)
        return buf

    def release(self, buf: torch.Tensor, event: Any = None) -> None:
        """Give `buf` back; `event` (if any) marks the end of the device work that still uses it."""
        with self._lock:
            self._free.append((buf, event))
            self._free.sort(key=lambda item: item[0].numel())

    @property
    def num_free(self) -> int:
        return len(self._free)


def view_as(buf: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
    """A dtype/shape view of bytes [offset, offset + size) of a uint8 buffer."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return buf[offset:offset + nbytes].view(dtype).view(shape)


@dataclass
class ReadTarget:
    """Where a store read of one layer of consecutive chunks of `chunk_lens` tokens should land: the
    pooled buffer `buffer`, viewed as `full` (the chunks back to back, [2, T, H, D])."""

    buffer: torch.Tensor
    full: torch.Tensor
    chunk_lens: list[int]

    def span_table(self) -> SpanTable:
        """Each chunk's K rows, then its V rows, in `full`, as one kvstore.spans.SpanTable (the pieces a coded
        read decodes into, kvstore/coded_reads.py)."""
        total = sum(self.chunk_lens)
        region = memoryview(self.full.view(-1).view(torch.uint8).numpy())
        row = region.nbytes // (2 * total) if total else 0
        starts = np.cumsum([0, *self.chunk_lens], dtype=np.int64)[:-1] * row
        sizes = np.asarray(self.chunk_lens, np.int64) * row
        desc = np.zeros((2 * len(self.chunk_lens), 3), np.int64)
        desc[0::2, 1], desc[1::2, 1] = starts, starts + total * row
        desc[0::2, 2] = desc[1::2, 2] = sizes
        return SpanTable([region], desc, np.arange(0, 2 * len(self.chunk_lens) + 1, 2, dtype=np.int64))

    def heads_table(self, chunks: list[int], group: tuple[int, int], heads: tuple[int, int]) -> SpanTable:
        """The pieces that objects of KV heads `group` of chunks `chunks` (indices into chunk_lens) fill, row by
        row as their payload runs ([2, n, group heads, D]): the heads also in `heads` (this buffer's, from
        heads[0]) into `full`, the others into a scratch piece (read and dropped). The read of chunks that
        another layout wrote, or whose writer split its heads into several objects."""
        total = sum(self.chunk_lens)
        head_bytes = self.full.shape[3] * self.full.element_size()
        row_bytes = self.full.shape[2] * head_bytes
        a, b = max(group[0], heads[0]), min(group[1], heads[1])
        before, own, after = (a - group[0]) * head_bytes, (b - a) * head_bytes, (group[1] - b) * head_bytes
        starts = np.cumsum([0, *self.chunk_lens], dtype=np.int64)
        pieces, first = [], [0]
        for j in chunks:
            rows = np.concatenate([kv * total + starts[j] + np.arange(self.chunk_lens[j], dtype=np.int64)
                                   for kv in (0, 1)])
            zeros, ones = np.zeros_like(rows), np.ones_like(rows)
            columns = [np.stack([zeros, rows * row_bytes + (a - heads[0]) * head_bytes, zeros + own], 1)]
            if before:
                columns.insert(0, np.stack([ones, zeros, zeros + before], 1))
            if after:
                columns.append(np.stack([ones, zeros, zeros + after], 1))
            pieces.append(np.stack(columns, 1).reshape(-1, 3))
            first.append(first[-1] + len(pieces[-1]))
        region = memoryview(self.full.view(-1).view(torch.uint8).numpy())
        scratch = memoryview(np.empty(max(before, after, 1), np.uint8))
        desc = np.ascontiguousarray(np.concatenate(pieces)) if pieces else np.zeros((0, 3), np.int64)
        return SpanTable([region, scratch], desc, np.asarray(first, np.int64))

    def retarget(self, table: SpanTable) -> SpanTable:
        """A heads_table of another buffer of the same shape, over this one (a load's layers share one)."""
        region = memoryview(self.full.view(-1).view(torch.uint8).numpy())
        return table.with_regions([region, memoryview(np.empty(table.regions[1].nbytes, np.uint8))])

    @property
    def out(self) -> list[torch.Tensor]:
        """Each chunk's token slice of `full` (its K half and V half stay contiguous)."""
        out, start = [], 0
        for n in self.chunk_lens:
            out.append(self.full[:, start:start + n])
            start += n
        return out


@dataclass
class BlockScatter:
    """A load's scatter into paged KV [2, num_blocks, block_size, H, D], a whole block per copy.

    The slots of a load's rows are the same for every layer, so they are planned once: the leading
    rows that fill whole blocks (block-aligned slots, consecutive within a block: what a load into
    freshly allocated blocks from a block-aligned N is) are copied block by block in one numpy
    fancy assignment of block-sized rows (memcpy speed, ~4x index_copy_ of token rows here); the
    rest (the last, partial block) goes through kernels.scatter_kv."""

    block_size: int
    blocks: np.ndarray  # destination block of each whole block of rows, in row order
    full_rows: int  # rows [0, full_rows) fill those blocks
    tail_slots: torch.Tensor  # slots of rows [full_rows, n)

    @classmethod
    def plan(cls, slots: torch.Tensor, block_size: int) -> BlockScatter | None:
        """None when the slots do not start with whole blocks (then kernels.scatter_kv does it all)."""
        if slots.device.type != "cpu":
            return None
        flat = slots.numpy()
        whole = len(flat) // block_size
        head = flat[:whole * block_size].reshape(whole, block_size)
        if whole and not ((head[:, 0] % block_size == 0).all()
                          and (head == head[:, :1] + np.arange(block_size)).all()):
            return None
        return cls(block_size, head[:, 0] // block_size, whole * block_size, slots[whole * block_size:])

    def applies_to(self, kv_cache: torch.Tensor, dtype: torch.dtype) -> bool:
        """Whether `kv_cache` has the paged layout this plan copies into, and rows of `dtype` are its
        bytes as they are (no conversion)."""
        return (kv_cache.device.type == "cpu" and kv_cache.dim() == 5 and kv_cache.shape[0] == 2
                and kv_cache.shape[2] == self.block_size and kv_cache.is_contiguous() and kv_cache.dtype == dtype)

    def __call__(self, kv_cache: torch.Tensor, rows: torch.Tensor) -> None:
        """Write rows [2, n, H, D] (each half contiguous) into the planned slots of `kv_cache`."""
        if self.full_rows:
            dst = kv_cache.view(torch.uint8).numpy().reshape(2, kv_cache.shape[1], -1)
            src = rows[:, :self.full_rows].view(torch.uint8).reshape(2, len(self.blocks), -1).numpy()
            dst[:, self.blocks] = src
        if len(self.tail_slots):
            kernels.scatter_kv(kv_cache, self.tail_slots, rows[:, self.full_rows:])


@dataclass
class HostChunks:
    """One layer's chunks of a save on the host, valid once `ready` completed."""

    tensors: list[torch.Tensor]
    ready: Any
    buffers: list[torch.Tensor] = field(default_factory=list)  # pool buffers to release after the put


class DirectTransfer:
    """The direct (CPU) way; StagedTransfer overrides every step of it."""

    # Store reads may land straight in paged memory (connectors/direct_rows.py): it is host memory.
    reads_in_place = True

    def __init__(self, platform: Platform) -> None:
        self.platform = platform
        self.pool = PinnedPool(platform)

    def begin_step(self) -> None:
        """Called on the compute thread before a step's loads are issued."""

    def read_target(self, chunk_lens: list[int], kv_shape: tuple[int, int], dtype: torch.dtype) -> ReadTarget:
        """One pooled buffer [2, T, H, D] for one layer of consecutive chunks of chunk_lens tokens, and
        each chunk's token slice of it for the store to read into (I/O thread)."""
        total = sum(chunk_lens)
        buf = self.pool.acquire(2 * total * kv_shape[0] * kv_shape[1] * dtype.itemsize)
        return ReadTarget(buf, view_as(buf, (2, total, *kv_shape), dtype), list(chunk_lens))

    def scatter_plan(self, slots: torch.Tensor, block_size: int) -> BlockScatter | None:
        """The per-load plan `load` may be given (compute thread, once per load)."""
        return BlockScatter.plan(slots, block_size)

    def load(self, kv_cache: torch.Tensor, lo: int, hi: int, slots: torch.Tensor,
             target: ReadTarget, plan: BlockScatter | None = None) -> Any:
        """Write tokens [lo, hi) of the chunks read into `target` (back to back) into `slots` with one
        scatter (`plan`'s block copies when it fits this cache), then hand the buffer back; returns the
        event marking the end (I/O thread). hi <= lo writes nothing and just hands the buffer back."""
        if hi > lo:
            if plan is not None and plan.applies_to(kv_cache, target.full.dtype):
                plan(kv_cache, target.full[:, lo:hi])
            else:
                kernels.scatter_kv(kv_cache, slots, target.full[:, lo:hi])
        self.pool.release(target.buffer)
        return self.platform.new_event()

    def wait(self, event: Any) -> None:
        """Make the compute stream wait for a load's event (compute thread)."""

    def fence(self) -> None:
        """Order every copy issued so far before the compute stream's next work (after a failed load:
        a copy already issued must land before the engine recomputes those blocks)."""

    def device_slots(self, slots: torch.Tensor) -> torch.Tensor:
        return slots

    def save(self, kv_cache: torch.Tensor, slots: torch.Tensor, chunk_lens: list[int]) -> HostChunks:
        """Gather tokens `slots` (chunk after chunk, chunk_lens tokens each) into contiguous host tensors."""
        tensors, start = [], 0
        for n in chunk_lens:
            tensors.append(kernels.gather_kv(kv_cache, slots[start:start + n]))
            start += n
        return HostChunks(tensors, self.platform.new_event())

    def release(self, chunks: HostChunks) -> None:
        """The put of these chunks is done (I/O thread)."""


class StagedTransfer(DirectTransfer):
    reads_in_place = False  # paged memory is on the device: reads land in pinned staging buffers

    def __init__(self, platform: Platform) -> None:
        super().__init__(platform)
        self.copy_stream = platform.new_stream()  # store reads -> device
        self.save_stream = platform.new_stream()  # device -> pinned host

    def begin_step(self) -> None:
        # Blocks this step's loads write may have been read (gathered for a save) or written by
        # kernels already issued on the compute stream: the copy stream goes after them.
        self.platform.wait_stream(self.copy_stream)

    def scatter_plan(self, slots: torch.Tensor, block_size: int) -> None:
        return None  # one scatter kernel on the device

    def load(self, kv_cache: torch.Tensor, lo: int, hi: int, slots: torch.Tensor,
             target: ReadTarget, plan: BlockScatter | None = None) -> Any:
        with self.platform.stream(self.copy_stream):
            if hi > lo:
                # The whole buffer (contiguous pinned bytes: one async DMA), then one scatter of its rows.
                rows = target.full.to(kv_cache.device, non_blocking=True)[:, lo:hi]
                kernels.scatter_kv(kv_cache, slots, rows)
            event = self._recorded(self.copy_stream)
        self.pool.release(target.buffer, event)
        return event

    def wait(self, event: Any) -> None:
        self.platform.wait_event(event)

    def fence(self) -> None:
        self.platform.wait_event(self._recorded(self.copy_stream))

    def _recorded(self, stream: Any) -> Any:
        event = self.platform.new_event()
        event.record(stream)
        return event

    def device_slots(self, slots: torch.Tensor) -> torch.Tensor:
        return slots.to(self.platform.device, non_blocking=True)

    def save(self, kv_cache: torch.Tensor, slots: torch.Tensor, chunk_lens: list[int]) -> HostChunks:
        rows = kernels.gather_kv(kv_cache, slots)  # [2, T, H, D] on the compute stream
        token_shape = rows.shape[2:]
        buf = self.pool.acquire(rows.numel() * rows.element_size())
        host = view_as(buf, (rows.numel(),), rows.dtype)
        # Equal leading chunks move in one copy (every chunk but the last of a prompt is full).
        n0 = chunk_lens[0]
        lead = next((i for i, n in enumerate(chunk_lens) if n != n0), len(chunk_lens))
        groups = [(0, lead, n0)] + [(i, 1, n) for i, n in enumerate(chunk_lens[lead:], start=lead)]
        tensors: list[torch.Tensor] = []
        compute = self.platform.current_stream()
        with self.platform.stream(self.save_stream):
            self.platform.wait_stream(self.save_stream, compute)
            start = 0
            for _, count, n in groups:  # chunk-major on the host: each chunk's bytes are contiguous
                dst = host[2 * start * token_shape.numel():2 * (start + count * n) * token_shape.numel()]
                dst = dst.view(count, 2, n, *token_shape)
                src = rows[:, start:start + count * n].view(2, count, n, *token_shape).transpose(0, 1)
                dst.copy_(src, non_blocking=True)
                tensors.extend(dst.unbind(0))
                start += count * n
            ready = self._recorded(self.save_stream)
        self.platform.record_stream(rows, self.save_stream)
        return HostChunks(tensors, ready, [buf])

    def release(self, chunks: HostChunks) -> None:
        for buf in chunks.buffers:
            self.pool.release(buf)


def use_staging(platform: Platform) -> bool:
    """Pinned staging and copy streams pay off only when a host<->device copy exists (CUDA)."""
    return platform.is_cuda


def make_kv_transfer(platform: Platform) -> DirectTransfer:
    return StagedTransfer(platform) if use_staging(platform) else DirectTransfer(platform)
