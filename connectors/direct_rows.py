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
from typing import Any

import numpy as np
import torch

from pdserve.kvstore.spans import SpanTable

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
             half_bytes: int, compiled: Any = None) -> DirectRows:
        """slots: the slot of each row in [lo, hi) (rows counted from the first chunk's first token);
        row_bytes: one token's K (or V) bytes; half_bytes: the K half of one layer's cache; compiled: a
        kvstore.native_reader.KVReadLibrary, which makes the same pieces in C (a few microseconds; the numpy
        way below costs ~0.1 ms warm and ~0.25 ms with the caches cold after a load, time in which no
        read has started yet).

        In numpy, with no loop over rows or pieces (it runs on the engine thread before any read starts:
        a per-piece Python loop cost ~0.4 ms of a 2048-token load's ~5 ms): the rows are cut at chunk
        boundaries, at lo and hi and where the slots stop being consecutive, and each cut segment is one
        K piece and one V piece (a cache segment lies inside one slot run, so its first slot places it)."""
        flat = np.ascontiguousarray(slots.numpy(), dtype=np.int64)
        if compiled is not None:
            desc, first = compiled.rows_plan(flat, chunk_lens, lo, hi, row_bytes, half_bytes)
            return cls(desc, first, 2 * (sum(chunk_lens) - (hi - lo)) * row_bytes)
        bounds = np.cumsum(np.asarray([0, *chunk_lens], np.int64))
        total = int(bounds[-1])
        breaks = lo + np.flatnonzero(np.diff(flat) != 1) + 1  # rows where a new slot run starts
        cuts = np.unique(np.concatenate((bounds, [lo, hi], breaks)))
        cuts = cuts[(cuts >= 0) & (cuts <= total)]
        starts, sizes = cuts[:-1], np.diff(cuts)
        chunk = np.searchsorted(bounds, starts, side="right") - 1
        in_cache = (starts >= lo) & (starts < hi)
        outside = total - (hi - lo)  # rows read into scratch: K's first, then V's
        scratch_sizes = np.where(in_cache, 0, sizes)
        scratch_at = np.cumsum(scratch_sizes) - scratch_sizes  # scratch rows handed out before each segment
        cache_at = flat[np.clip(starts - lo, 0, max(len(flat) - 1, 0))] if len(flat) else np.zeros_like(starts)
        k_offset = np.where(in_cache, cache_at, scratch_at) * row_bytes
        v_offset = np.where(in_cache, cache_at * row_bytes + half_bytes, (outside + scratch_at) * row_bytes)
        where = np.where(in_cache, _CACHE, _SCRATCH)
        # Per chunk its K pieces, then its V pieces: a stable sort on (chunk, half).
        desc = np.stack((np.concatenate((where, where)), np.concatenate((k_offset, v_offset)),
                         np.concatenate((sizes, sizes)) * row_bytes), axis=1)
        order = np.argsort(np.concatenate((2 * chunk, 2 * chunk + 1)), kind="stable")
        desc = np.ascontiguousarray(desc[order], dtype=np.int64)
        first = np.zeros(len(chunk_lens) + 1, np.int64)
        first[1:] = np.cumsum(2 * np.bincount(chunk, minlength=len(chunk_lens)))
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
