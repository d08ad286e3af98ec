"""The pool of paged-KV blocks: reference counts, the free queue and the prefix-cache index.

A block whose last user went away is not wiped: it goes to the tail of the free queue
still carrying its hash, so a later request with the same prefix can revive it. New
allocations take blocks from the head (least recently freed), and only then is a cached
block's hash dropped — that is the LRU eviction of cached-but-free blocks.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set only once the block is full and its KV is valid


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least 1 block, got {num_blocks}")
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # Insertion order = eviction order (head is evicted first); O(1) removal on revival.
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[bytes, KVCacheBlock] = {}
        # Told the hashes each allocation evicts (KVCacheManager.set_listener: KV events); step thread, so it
        # must only enqueue.
        self.on_evict: Callable[[list[bytes]], None] | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def lookup(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def take_new(self, n: int) -> list[KVCacheBlock]:
        """Pop `n` blocks from the head of the free queue, evicting their cached hashes."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} blocks with only {self.num_free_blocks} free")
        out = []
        evicted: list[bytes] = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                evicted.append(block.block_hash)
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
        return out

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, reviving free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks: list[KVCacheBlock]) -> None:
        """Drop a reference; blocks reaching zero join the free-queue tail in the given order."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"block {block.block_id} released more often than taken")
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def reset_prefix_cache(self) -> int:
        """Forget every cached block's hash (free ones and those requests still hold): later lookups miss.
        The KV stays where it is, for the requests that hold it; the number of blocks forgotten."""
        for block in self.cached.values():
            block.block_hash = None
        forgotten, self.cached = len(self.cached), {}
        return forgotten

    def register(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Index a full block with valid KV; an equal block already indexed keeps its place."""
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block
