"""docs/architecture.md's hit and load arithmetic as pure functions: what to load, read, write and save.

Kept free of I/O and engine state so every connector (store, LMCache) shares one copy of the
arithmetic and the unit tests can pin it down exhaustively.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoadPlan:
    """Decode-side plan for one request: T prompt tokens, N local, H hit, chunk size C."""

    num_tokens: int  # T
    num_local: int  # N (block-aligned local prefix-cache hit)
    hit: int  # H (tokens covered by the longest present chunk prefix)
    chunk_size: int  # C
    # Output tokens the request already has (handed over by the prefill node, or resumed): with any,
    # the prompt's last token needs no logits here, so its KV loads too.
    num_outputs: int = 0

    @property
    def need_to_load(self) -> int:
        """Tokens to bring in: the request's last token is always computed to produce logits."""
        return max(0, min(self.hit, self.num_tokens + self.num_outputs - 1) - self.num_local)

    @property
    def aligned_start(self) -> int:
        """Chunks are the unit of transfer, so the read starts at N's chunk boundary."""
        return (self.num_local // self.chunk_size) * self.chunk_size

    @property
    def retrieved(self) -> int:
        """Tokens read from the store (whole chunks [aligned_start, H)); 0 when nothing is loaded."""
        return self.hit - self.aligned_start if self.need_to_load else 0

    @property
    def write_range(self) -> tuple[int, int]:
        """Tokens written into newly allocated blocks: [N, N + need_to_load)."""
        return self.num_local, self.num_local + self.need_to_load

    @property
    def chunk_range(self) -> range:
        """Indices of the chunks that are read."""
        if not self.need_to_load:
            return range(0)
        return range(self.aligned_start // self.chunk_size, -(-self.hit // self.chunk_size))


def chunk_bounds(chunk_idx: int, num_tokens: int, chunk_size: int) -> tuple[int, int]:
    """Token range [start, end) of chunk `chunk_idx` of a `num_tokens` prompt (the last may be partial)."""
    start = chunk_idx * chunk_size
    return start, min(start + chunk_size, num_tokens)


def hit_tokens(num_present_chunks: int, num_tokens: int, chunk_size: int) -> int:
    """H from the count of leading present chunks (the last chunk may be partial)."""
    return min(num_present_chunks * chunk_size, num_tokens)


def savable_end(num_tokens: int, computed_end: int, chunk_size: int) -> int:
    """End of the complete chunks once `computed_end` prompt tokens are in paged memory.

    A full chunk is complete as soon as its last token is computed (chunked prefill saves it
    right away); the partial last chunk is complete only with the whole prompt.
    """
    if computed_end >= num_tokens:
        return num_tokens
    return (computed_end // chunk_size) * chunk_size


def save_range(num_tokens: int, computed_end: int, saved_end: int, skip_leading_tokens: int,
               chunk_size: int) -> tuple[int, int]:
    """Tokens [a, b) to store after a step; a == b means nothing new is complete.

    `saved_end` is what earlier steps already stored (or skipped); `skip_leading_tokens` is the
    chunk-aligned prefix already present in the store, which is never written again.
    """
    start = max(saved_end, skip_leading_tokens)
    end = savable_end(num_tokens, computed_end, chunk_size)
    return (start, end) if end > start else (start, start)


def slots_for(block_ids: list[int], start: int, end: int, block_size: int) -> torch.Tensor:
    """Slot of each token in [start, end) given the request's block table."""
    pos = torch.arange(start, end, dtype=torch.long)
    table = torch.tensor(block_ids, dtype=torch.long)
    return table[pos // block_size] * block_size + pos % block_size
