"""KVCacheManager and BlockPool without a model: ref counts, prefix hits, LRU eviction, hashing."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams

BS = 16
FP = "f" * 32


def req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), eos_token_id=1, cache_salt=salt)


def admit(kv: KVCacheManager, r: Request) -> int:
    """Lookup + allocate the whole prompt, as the scheduler does; returns the local hit."""
    blocks, hit = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - hit, blocks) is not None
    r.num_computed_tokens = r.num_tokens
    return hit


def test_ref_counts_and_shared_prefix():
    kv = KVCacheManager(num_blocks=10, block_size=BS, fingerprint=FP)
    a = req("a", range(40))
    assert admit(kv, a) == 0
    assert len(kv.get_block_ids("a")) == 3 and kv.num_free_blocks == 7
    kv.cache_blocks(a, a.num_computed_tokens)
    b = req("b", list(range(32)) + [999] * 5)
    assert admit(kv, b) == 32
    assert kv.get_block_ids("b")[:2] == kv.get_block_ids("a")[:2]
    shared = kv.pool.blocks[kv.get_block_ids("a")[0]]
    assert shared.ref_cnt == 2 and kv.num_free_blocks == 6
    kv.free(a)
    assert shared.ref_cnt == 1 and kv.num_free_blocks == 7
    kv.free(b)
    assert shared.ref_cnt == 0 and kv.num_free_blocks == 10 and kv.usage == 0.0
    # freed blocks stay cached: a third request still hits them
    c = req("c", range(40))
    assert kv.get_computed_blocks(c)[1] == 32


def test_last_token_is_never_a_hit_and_salt_separates_tenants():
    kv = KVCacheManager(num_blocks=10, block_size=BS, fingerprint=FP)
    a = req("a", range(32))
    admit(kv, a)
    kv.cache_blocks(a, 32)
    assert kv.get_computed_blocks(req("same", range(32)))[1] == 16  # 32 would leave nothing to compute
    assert kv.get_computed_blocks(req("longer", range(33)))[1] == 32
    assert kv.get_computed_blocks(req("salted", range(33), salt="tenant-2"))[1] == 0
    other = KVCacheManager(num_blocks=10, block_size=BS, fingerprint="0" * 32)
    assert other.block_hashes(req("x", range(32))) != kv.block_hashes(req("y", range(32)))


def test_blocks_are_cached_only_after_their_kv_is_valid():
    kv = KVCacheManager(num_blocks=10, block_size=BS, fingerprint=FP)
    a = req("a", range(48))
    admit(kv, a)
    assert kv.get_computed_blocks(req("b", range(49)))[1] == 0  # allocated, not yet computed
    kv.cache_blocks(a, 20)  # one full block written so far
    assert kv.get_computed_blocks(req("b", range(49)))[1] == 16
    kv.cache_blocks(a, 48)
    assert kv.get_computed_blocks(req("b", range(49)))[1] == 48


def test_lru_eviction_of_cached_free_blocks():
    kv = KVCacheManager(num_blocks=4, block_size=BS, fingerprint=FP)
    a, b = req("a", range(32)), req("b", range(100, 132))
    for r in (a, b):
        admit(kv, r)
        kv.cache_blocks(r, 32)
    kv.free(a)  # a's blocks are the least recently freed
    kv.free(b)
    assert kv.num_free_blocks == 4
    c = req("c", range(200, 232))
    admit(kv, c)  # needs 2 blocks: evicts a's, keeps b's
    assert kv.get_computed_blocks(req("a2", range(33)))[1] == 0
    assert kv.get_computed_blocks(req("b2", range(100, 133)))[1] == 32
    # b's blocks were freed before c's, but a hit revives them and a later free puts them at the tail
    kv.free(c)
    b3 = req("b3", range(100, 133))
    assert admit(kv, b3) == 32
    kv.free(b3)
    admit(kv, req("d", range(300, 332)))
    assert kv.get_computed_blocks(req("b4", range(100, 133)))[1] == 32


def test_tail_blocks_are_evicted_before_the_prefix():
    kv = KVCacheManager(num_blocks=4, block_size=BS, fingerprint=FP)
    a = req("a", range(64))
    admit(kv, a)
    kv.cache_blocks(a, 64)
    kv.free(a)
    admit(kv, req("b", range(500, 516)))  # takes one block: a's last one
    assert kv.get_computed_blocks(req("a2", range(65)))[1] == 48


def test_allocate_returns_none_without_side_effects():
    kv = KVCacheManager(num_blocks=4, block_size=BS, fingerprint=FP)
    a = req("a", range(48))
    admit(kv, a)
    kv.cache_blocks(a, 48)
    kv.free(a)
    b = req("b", range(80))  # 48 hit + 32 new = 5 blocks > 4
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == 48
    assert kv.allocate_slots(b, 32, blocks) is None
    assert kv.num_free_blocks == 4 and all(blk.ref_cnt == 0 for blk in blocks)
    assert kv.get_block_ids("b") == []
    # growing a running request one token at a time crosses block boundaries
    c = req("c", range(16))
    assert kv.allocate_slots(c, 16) is not None and len(kv.get_block_ids("c")) == 1
    c.num_computed_tokens = 16
    c.append_output_token(7)
    assert kv.allocate_slots(c, 1) is not None and len(kv.get_block_ids("c")) == 2


def test_disabled_prefix_caching_never_hits():
    kv = KVCacheManager(num_blocks=8, block_size=BS, fingerprint=FP, enable_prefix_caching=False)
    a = req("a", range(40))
    admit(kv, a)
    kv.cache_blocks(a, 40)
    assert kv.get_computed_blocks(req("b", range(40)))[1] == 0


HASH_SCRIPT = """
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
kv = KVCacheManager(num_blocks=4, block_size=16, fingerprint="f" * 32)
r = Request("x", list(range(1000, 1050)), SamplingParams(), cache_salt="s")
print(",".join(h.hex() for h in kv.block_hashes(r)))
"""


def test_hashes_are_identical_across_processes():
    root = Path(__file__).resolve().parents[2]
    outs = []
    for seed in ("1", "2"):  # different str-hash salts: Python's hash() would differ
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=str(root))
        outs.append(subprocess.run([sys.executable, "-c", HASH_SCRIPT], env=env, capture_output=True,
                                   text=True, check=True, cwd=root).stdout.strip())
    kv = KVCacheManager(num_blocks=4, block_size=16, fingerprint="f" * 32)
    local = ",".join(h.hex() for h in kv.block_hashes(
        Request("x", list(range(1000, 1050)), SamplingParams(), cache_salt="s")))
    assert outs[0] == outs[1] == local
    assert len(local.split(",")) == 3


def test_incremental_hashes_equal_hashing_at_once():
    kv = KVCacheManager(num_blocks=4, block_size=BS, fingerprint=FP)
    grown = req("g", range(20))
    kv.block_hashes(grown)
    for t in range(40):
        grown.append_output_token(t)
        kv.block_hashes(grown)
    assert grown.block_hashes == kv.block_hashes(req("w", grown.all_token_ids))
    assert len(grown.block_hashes) == 60 // BS


def test_block_id_lists_follow_the_blocks_through_hits_growth_forks_and_frees():
    """req_to_block_ids (what each step's block tables copy) always names req_to_blocks' blocks, and
    get_block_ids hands out copies that later growth does not change."""
    kv = KVCacheManager(num_blocks=12, block_size=BS, fingerprint=FP)

    def check() -> None:
        assert kv.req_to_block_ids.keys() == kv.req_to_blocks.keys()
        for rid, blocks in kv.req_to_blocks.items():
            assert kv.req_to_block_ids[rid] == [b.block_id for b in blocks] == kv.get_block_ids(rid)

    a = req("a", range(40))
    admit(kv, a)
    kv.cache_blocks(a, 40)
    check()
    b = req("b", list(range(32)) + [7] * 9)  # two cached blocks, then its own
    admit(kv, b)
    check()
    before = kv.get_block_ids("b")
    b.num_computed_tokens = b.num_tokens
    assert kv.allocate_slots(b, 20) is not None  # decode growth past its last block
    check()
    assert kv.get_block_ids("b")[:len(before)] == before and len(kv.get_block_ids("b")) > len(before)
    c = req("c", range(40))
    c.num_computed_tokens = 0
    assert kv.fork(a, c) is not None  # a's partial last block is copied into c's own
    check()
    kv.free(a)
    check()
    kv.free(b)
    kv.free(c)
    check()
    assert kv.get_block_ids("a") == [] and kv.num_free_blocks == 12
