"""KVCacheManager: which paged-KV blocks each request owns, and prefix caching over them.

Prefix caching works on full blocks only. Block i of a request is named by the hash chain
h_i = H(h_{i-1} || tokens of block i) with h_{-1} = H(model fingerprint || cache salt [|| LoRA
adapter fingerprint]) (common/hashing.py), so equal prefixes of the same model, tenant and adapter
get equal names in every process, and no other adapter (nor the base model) finds them. A block is
indexed only after the step that wrote its KV has finished (`cache_blocks`), never at allocation
time: external loads may still fail and be rewound.
"""
from __future__ import annotations

from typing import Protocol

from pdserve.common.hashing import chain_seed, hash_chain
from pdserve.engine.block_pool import BlockPool, KVCacheBlock
from pdserve.engine.request import Request


class PrefixCacheListener(Protocol):
    """Told what enters and leaves the prefix cache (the serving layer's KV event publisher, serving/kv_events.py:
    the engine knows no transport). Called on the engine's step thread: implementations only enqueue."""

    def blocks_stored(self, request: Request, start: int, end: int) -> None:
        """The request's leading `end` blocks are indexed now; [start, end) just were."""

    def blocks_removed(self, block_hashes: list[bytes]) -> None:
        """These hashes left the index (their blocks were evicted for new allocations)."""

    def cache_cleared(self) -> None:
        """reset_prefix_cache: every hash left the index."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, fingerprint: str,
                 enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.fingerprint = fingerprint
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # The same blocks' ids, kept beside them: every step hands each scheduled request's whole
        # block table to the model runner, and copying a list of ints is several times cheaper than
        # reading .block_id off each block (invariant: req_to_block_ids[r] == ids of req_to_blocks[r]).
        self.req_to_block_ids: dict[str, list[int]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks of a request already indexed
        self.prefix_cache_queries = 0  # tokens looked up at admission
        self.prefix_cache_hits = 0  # of those, tokens found in the local prefix cache
        self.listener: PrefixCacheListener | None = None

    def set_listener(self, listener: PrefixCacheListener | None) -> None:
        """Report index changes to `listener` from now on (None: stop)."""
        self.listener = listener
        self.pool.on_evict = listener.blocks_removed if listener is not None else None

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_hashes(self, request: Request) -> list[bytes]:
        """Extend `request.block_hashes` to cover every full block of its current tokens."""
        hashes = request.block_hashes
        done = len(hashes) * self.block_size
        if request.num_tokens - done >= self.block_size:
            seed = hashes[-1] if hashes else chain_seed(self.fingerprint, request.cache_salt,
                                                       request.lora_fingerprint)
            hashes.extend(hash_chain(seed, request.all_token_ids[done:], self.block_size, include_partial=False))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached leading blocks, capped so the last token is always computed."""
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in self.block_hashes(request)[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Counted once per admission, so a request that waits for room is not counted per step."""
        self.prefix_cache_queries += num_query_tokens
        self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       num_external_tokens: int = 0) -> list[int] | None:
        """Make room for local hits + external tokens + `num_new_tokens`; None if the pool is short.

        Returns the ids of the newly allocated blocks. Nothing changes when it returns None.
        """
        computed = new_computed_blocks or []
        held = self.req_to_blocks.get(request.request_id, [])
        total_tokens = (request.num_computed_tokens + len(computed) * self.block_size
                        + num_external_tokens + num_new_tokens)
        num_needed = cdiv(total_tokens, self.block_size) - len(held) - len(computed)
        revived = sum(1 for b in computed if b.ref_cnt == 0)  # they leave the free queue too
        if num_needed > self.pool.num_free_blocks - revived:
            return None
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        ids = self.req_to_block_ids.setdefault(request.request_id, [])
        if computed:
            self.pool.touch(computed)
            blocks.extend(computed)
            ids.extend(b.block_id for b in computed)
            self.num_cached_blocks[request.request_id] = len(blocks)
        new = self.pool.take_new(max(num_needed, 0))
        blocks.extend(new)
        new_ids = [b.block_id for b in new]
        ids.extend(new_ids)
        return new_ids

    def reset_prefix_cache(self) -> int:
        """Empty the prefix cache (vLLM's reset_prefix_cache); the blocks forgotten. Requests in flight keep
        their blocks; their blocks already indexed stay unindexed (the next ones are indexed as usual)."""
        forgotten = self.pool.reset_prefix_cache()
        if self.listener is not None:
            self.listener.cache_cleared()
        return forgotten

    def cache_blocks(self, request: Request, num_valid_tokens: int) -> None:
        """Index the request's full blocks among its first `num_valid_tokens` (their KV is written)."""
        if not self.enable_prefix_caching:
            return
        blocks = self.req_to_blocks.get(request.request_id, [])
        start = self.num_cached_blocks.get(request.request_id, 0)
        end = min(num_valid_tokens // self.block_size, len(blocks))
        if end <= start:
            return
        hashes = self.block_hashes(request)
        for i in range(start, end):
            self.pool.register(blocks[i], hashes[i])
        self.num_cached_blocks[request.request_id] = end
        if self.listener is not None:
            self.listener.blocks_stored(request, start, end)

    def fork(self, parent: Request, child: Request) -> tuple[int, int] | None | bool:
        """Give `child` the parent's computed prompt: its full blocks shared (one more reference
        each), its partial last block copied into a new block the child owns.

        Returns the (source, destination) block ids to copy, None when nothing needs copying,
        or False when no block is free for the copy (nothing changed then).
        """
        num_tokens = parent.num_computed_tokens
        blocks = self.req_to_blocks[parent.request_id]
        num_full = num_tokens // self.block_size
        partial = num_tokens % self.block_size != 0
        if partial and self.pool.num_free_blocks < 1:
            return False
        shared = blocks[:num_full]
        self.pool.touch(shared)
        owned = list(shared)
        copy = None
        if partial:
            new = self.pool.take_new(1)[0]
            owned.append(new)
            copy = (blocks[num_full].block_id, new.block_id)
        self.req_to_blocks[child.request_id] = owned
        self.req_to_block_ids[child.request_id] = [b.block_id for b in owned]
        self.num_cached_blocks[child.request_id] = min(self.num_cached_blocks.get(parent.request_id, 0), num_full)
        child.block_hashes = list(self.block_hashes(parent)[:num_full])
        return copy

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its prefix outlives its tail in the LRU."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.req_to_block_ids.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.release(list(reversed(blocks)))

    def get_block_ids(self, request_id: str) -> list[int]:
        """A copy: callers (the step's block tables, the connector) may keep it while the request grows."""
        ids = self.req_to_block_ids.get(request_id)
        return list(ids) if ids else []
