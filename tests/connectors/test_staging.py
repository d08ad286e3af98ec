"""The connectors' KV data path (connectors/staging.py) on the CPU platform.

StagedTransfer is the CUDA path (pinned pool, copy/save streams, events); with the CPU platform
its copies are memcpys and its events no-ops, so its layout logic and buffer bookkeeping run
here. The one thing only a GPU shows — a pooled buffer is not reused before the copy that used
it finished — is checked with an event whose completion the test controls (a CUDA event's role).
"""
from __future__ import annotations

import threading

import torch

import pytest

from pdserve.connectors.chunk_math import slots_for
from pdserve.connectors.staging import BlockScatter, DirectTransfer, PinnedPool, StagedTransfer, make_kv_transfer, use_staging
from pdserve.engine.device import Platform
from pdserve.kernels import torch_ref

CPU = Platform(torch.device("cpu"))


class PendingEvent:
    """Stands in for a CUDA event recorded after a copy that has not finished yet."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.waited = False

    def synchronize(self) -> None:
        self.waited = True
        assert self.done.wait(10), "the copy never finished"


def test_pinned_pool_reuses_buffers_only_after_their_copy_finished():
    pool = PinnedPool(CPU)
    a = pool.acquire(3 << 20)
    assert a.dtype == torch.uint8 and a.numel() == 4 << 20  # powers of two from 1 MiB
    assert pool.acquire(10).numel() == 1 << 20
    event = PendingEvent()
    pool.release(a, event)
    threading.Timer(0.05, event.done.set).start()
    again = pool.acquire(2 << 20)  # the only free buffer big enough: waits for its event first
    assert again.data_ptr() == a.data_ptr() and event.waited and event.done.is_set()
    assert pool.num_allocations == 2 and pool.num_acquired == 3
    pool.release(again)
    small = pool.acquire(1)  # smallest fitting buffer first
    assert small.numel() == 4 << 20 and pool.acquire(5 << 20).numel() == 8 << 20


def cache_and_slots(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, 12, 16, 2, 8, generator=gen).to(torch.bfloat16)
    return cache, torch.randperm(12 * 16, generator=gen)[:150]


def test_staged_save_is_chunk_major_and_equals_the_direct_gather():
    cache, slots = cache_and_slots(0)
    chunk_lens = [64, 64, 22]
    direct = DirectTransfer(CPU).save(cache, slots, chunk_lens)
    staged_transfer = StagedTransfer(CPU)
    staged = staged_transfer.save(cache, slots, chunk_lens)
    assert [t.shape for t in staged.tensors] == [(2, 64, 2, 8), (2, 64, 2, 8), (2, 22, 2, 8)]
    for s, d, lo in zip(staged.tensors, direct.tensors, (0, 64, 128)):
        assert s.is_contiguous() and torch.equal(s, d)
        assert torch.equal(s, torch_ref.gather_kv(cache, slots[lo:lo + s.shape[1]]))
    # one pooled buffer behind all chunks, back in the pool after the put
    assert len(staged.buffers) == 1 and staged_transfer.pool.num_free == 0
    staged_transfer.release(staged)
    assert staged_transfer.pool.num_free == 1


def test_staged_load_is_one_buffer_per_layer_and_writes_only_the_needed_rows():
    cache, slots = cache_and_slots(1)
    direct_cache = cache.clone()
    transfer = StagedTransfer(CPU)
    target = transfer.read_target([64, 30], (2, 8), torch.bfloat16)
    assert [t.shape for t in target.out] == [(2, 64, 2, 8), (2, 30, 2, 8)] and target.full.shape == (2, 94, 2, 8)
    assert target.out[1].data_ptr() == target.full[:, 64:].data_ptr()  # chunks back to back in one buffer
    for t in target.out:  # what a store read puts there
        t.copy_(torch.randn(t.shape).to(torch.bfloat16))
    # the first 10 tokens are already local: rows [10, 94) are written, into slots[:84]
    expected = cache.clone()
    torch_ref.scatter_kv(expected, slots[:84], target.full[:, 10:94])
    transfer.begin_step()
    event = transfer.load(cache, 10, 94, slots[:84], target)
    transfer.wait(event)
    transfer.fence()
    assert torch.equal(cache, expected) and transfer.pool.num_free == 1
    # the direct (CPU) path reads into one pooled buffer too and writes the same rows with one scatter
    direct = DirectTransfer(CPU)
    for _ in range(2):  # the second load reuses the first one's buffer
        direct_target = direct.read_target([64, 30], (2, 8), torch.bfloat16)
        for t, src in zip(direct_target.out, target.out):
            t.copy_(src)
        direct.load(direct_cache, 10, 94, slots[:84], direct_target)
        assert torch.equal(direct_cache, expected)
    assert direct.pool.num_allocations == 1 and direct.pool.num_free == 1


def test_the_device_picks_the_transfer():
    assert type(make_kv_transfer(CPU)) is DirectTransfer
    assert use_staging(Platform(torch.device("cuda", 0))) and not use_staging(CPU)


@pytest.mark.parametrize("case", ["shuffled blocks, partial last block", "whole blocks only",
                                  "consecutive blocks", "starts mid-block", "one partial block"])
def test_direct_load_copies_whole_blocks_and_equals_the_reference_scatter(case):
    """DirectTransfer's planned scatter (whole blocks by numpy, the tail by kernels.scatter_kv) writes the
    same cache as one reference scatter, on the engine's own paged layout, and nothing else."""
    block_size, num_blocks = 16, 12
    start, end, block_ids = {"shuffled blocks, partial last block": (32, 90, [7, 3, 10, 1, 5, 0]),
                             "whole blocks only": (16, 64, [2, 9, 4, 6]),
                             "consecutive blocks": (0, 70, [4, 5, 6, 7, 8]),
                             "starts mid-block": (20, 60, [3, 1, 8, 2]),
                             "one partial block": (48, 55, [0, 1, 2, 9])}[case]
    slots = slots_for(block_ids, start, end, block_size)
    cache = CPU.allocate_kv_caches(1, num_blocks, block_size, 2, 8, torch.bfloat16)[0]
    cache.copy_(torch.randn(cache.shape).to(torch.bfloat16))
    expected = cache.clone()
    transfer = DirectTransfer(CPU)
    target = transfer.read_target([64, 64], (2, 8), torch.bfloat16)
    target.full.copy_(torch.randn(target.full.shape).to(torch.bfloat16))
    lo = start - (start // 64) * 64  # rows of the chunk-aligned read that are written
    torch_ref.scatter_kv(expected, slots, target.full[:, lo:lo + end - start])
    plan = transfer.scatter_plan(slots, block_size)
    assert (plan is None) == (case == "starts mid-block")  # then kernels.scatter_kv writes it all
    if plan is not None:
        assert plan.full_rows == (end - start) // block_size * block_size and plan.applies_to(cache, torch.bfloat16)
        assert not plan.applies_to(cache, torch.float32)  # another dtype is converted by kernels.scatter_kv
    transfer.load(cache, lo, lo + end - start, slots, target, plan)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    assert not BlockScatter.plan(slots_for([1, 2], 0, 32, block_size).flip(0), block_size)  # rows out of order
