"""Where a store read puts each byte of a load when it reads straight into paged KV (docs/architecture.md, §7).

A stored object holds one layer of one chunk: its K rows, then its V rows, token after token.
In a paged KV cache [2, num_blocks, block_size, H, D] (contiguous) a token's K row sits at byte
slot * row_bytes of the K half, its V row at the same offset of the V half, so a run of
consecutive slots is one contiguous span of each half. `DirectRows` cuts every chunk's payload
into such spans, once per load (every layer has the same slots):

- rows in the load's write range [lo, hi) go to their slots (only the request's own, freshly
  allocated blocks: rows before N may sit in prefix-cached blocks shared with other requests,
  and the last prompt token's row is computed, so neither is ever written);
- every other row of a chunk goes to scratch memory of the reading thread (the checksum covers
  the whole object, so those bytes are read all the same).

`spans(cache_bytes, scratch)` turns that plan into one layer's kvstore.spans.SpanTable for
KVStore.get_layer_spans, which writes them only inside the load's gate (kvstore.gate).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvstore.spans import SpanTable

_CACHE, _SCRATCH = 0, 1


@dataclass
class DirectRows:
    """Per chunk, its payload as (where, byte offset, nbytes) pieces: K pieces then V pieces (`desc` rows
    first[j]:first[j + 1] for chunk j, the layout of kvstore.spans.SpanTable)."""

    desc: np.ndarray  # int64 [pieces, 3]
    first: np.ndarray  # int64 [chunks + 1]
    scratch_bytes: int
    _table: SpanTable | None = field(default=None, repr=False, compare=False)  # the checked table (spans())

    @classmethod
    def plan(cls, slots: torch.Tensor, chunk_lens: list[int], lo: int, hi: int, row_bytes: int,
             half_bytes: int) -> DirectRows:
        """slots: the slot of each row in [lo, hi) (rows counted from the first chunk's first token);
        row_bytes: one token's K (or V) bytes; half_bytes: the K half of one layer's cache."""
        flat = slots.numpy().astype(np.int64, copy=False)
        breaks = np.flatnonzero(np.diff(flat) != 1) + 1
        run_starts = np.concatenate(([0], breaks)).tolist()  # row index (from lo) where each slot run starts
        run_ends = np.concatenate((breaks, [len(flat)])).tolist()
        first_slots = flat[run_starts].tolist() if len(flat) else []
        total = sum(chunk_lens)
        outside = lo + (total - hi)  # rows read into scratch: K's first, then V's
        used = 0  # scratch rows handed out so far
        pieces: list[list[tuple[int, int, int]]] = []
        start, run = 0, 0
        for n in chunk_lens:
            end = start + n
            k: list[tuple[int, int, int]] = []
            v: list[tuple[int, int, int]] = []
            for a, b, where in ((start, min(end, lo), _SCRATCH), (max(start, lo), min(end, hi), _CACHE),
                                (max(start, hi), end, _SCRATCH)):
                if where == _SCRATCH and b > a:
                    k.append((_SCRATCH, used * row_bytes, (b - a) * row_bytes))
                    v.append((_SCRATCH, (outside + used) * row_bytes, (b - a) * row_bytes))
                    used += b - a
                while where == _CACHE and a < b:  # cut at slot-run boundaries
                    while run_ends[run] <= a - lo:
                        run += 1
                    stop = min(b, lo + run_ends[run])
                    offset = (first_slots[run] + a - lo - run_starts[run]) * row_bytes
                    k.append((_CACHE, offset, (stop - a) * row_bytes))
                    v.append((_CACHE, half_bytes + offset, (stop - a) * row_bytes))
                    a = stop
            pieces.append(k + v)
            start = end
        first = np.cumsum([0] + [len(chunk) for chunk in pieces], dtype=np.int64)
        desc = np.array([piece for chunk in pieces for piece in chunk], np.int64).reshape(-1, 3)
        return cls(desc, first, 2 * outside * row_bytes)

    def spans(self, cache_bytes: memoryview, scratch: memoryview) -> SpanTable:
        """Each chunk's spans in one layer's cache (its flat bytes) and in `scratch` (>= scratch_bytes).
        The table is checked once per load; the other layers reuse it over their own regions."""
        table = self._table
        if table is None:
            table = self._table = SpanTable([cache_bytes, scratch], self.desc, self.first)
            return table
        return table.with_regions([cache_bytes, scratch])


def cache_bytes(kv_cache: torch.Tensor) -> memoryview:
    """The flat bytes of one layer's paged KV cache, writable (reads land in them)."""
    return memoryview(kv_cache.view(-1).view(torch.uint8).numpy())


def applies_to(kv_cache: torch.Tensor, dtype: torch.dtype, block_size: int) -> bool:
    """Whether `kv_cache` has the layout DirectRows addresses: contiguous CPU [2, num_blocks,
    block_size, H, D] holding `dtype` (the stored bytes as they are)."""
    return (kv_cache.device.type == "cpu" and kv_cache.dim() == 5 and kv_cache.shape[0] == 2
            and kv_cache.shape[2] == block_size and kv_cache.is_contiguous() and kv_cache.dtype == dtype)
