"""The hit/load arithmetic of docs/architecture.md, pinned down without a model or a store."""
from __future__ import annotations

import pytest
import torch

from pdserve.connectors.chunk_math import LoadPlan, chunk_bounds, hit_tokens, save_range, savable_end, slots_for
from pdserve.connectors.kv_log import load_line, lookup_line, save_line

C = 256


def test_worked_example_from_the_design():
    plan = LoadPlan(num_tokens=600, num_local=288, hit=512, chunk_size=C)
    assert plan.need_to_load == 224
    assert plan.aligned_start == 256
    assert plan.retrieved == 256
    assert plan.write_range == (288, 512)
    assert list(plan.chunk_range) == [1]


@pytest.mark.parametrize("T,N,H,outputs,need", [
    (256, 0, 256, 1, 256),  # the first output token came with the request: the prompt's last token loads too
    (257, 0, 257, 3, 257),  # resumed after 3 tokens: the whole prompt loads, the outputs are recomputed
    (513, 0, 512, 1, 512),  # the hit still bounds it
    (600, 288, 512, 1, 224),
])
def test_load_plan_with_known_outputs(T, N, H, outputs, need):
    plan = LoadPlan(T, N, H, C, num_outputs=outputs)
    assert plan.need_to_load == need and plan.write_range == (N, N + need)
    assert plan.retrieved == (H - N // C * C if need else 0)


@pytest.mark.parametrize("T,N,H,need,start,retrieved,chunks", [
    (1, 0, 1, 0, 0, 0, []),  # a one-token prompt is always computed
    (2, 0, 2, 1, 0, 2, [0]),
    (256, 0, 256, 255, 0, 256, [0]),  # full hit: the last token is recomputed
    (257, 0, 257, 256, 0, 257, [0, 1]),  # partial last chunk of one token is read too
    (513, 0, 512, 512, 0, 512, [0, 1]),  # hit ends before the last token: nothing recomputed beyond it
    (1000, 512, 1000, 487, 512, 488, [2, 3]),  # N chunk-aligned
    (1000, 560, 1000, 439, 512, 488, [2, 3]),  # N not chunk-aligned: 48 tokens read but already local
    (600, 512, 256, 0, 512, 0, []),  # N > H: nothing to load
    (600, 256, 256, 0, 256, 0, []),  # N == H
    (600, 0, 0, 0, 0, 0, []),  # miss
])
def test_load_plan(T, N, H, need, start, retrieved, chunks):
    plan = LoadPlan(T, N, H, C)
    assert plan.need_to_load == need
    assert plan.aligned_start == start
    assert plan.retrieved == retrieved
    assert list(plan.chunk_range) == chunks
    assert plan.write_range == (N, N + need)
    if need:  # every written token lies inside the chunks that are read
        first, last = chunk_bounds(chunks[0], T, C)[0], chunk_bounds(chunks[-1], T, C)[1]
        assert first <= N and N + need <= last == H


def test_chunk_bounds_and_hits():
    assert chunk_bounds(0, 1000, C) == (0, 256)
    assert chunk_bounds(3, 1000, C) == (768, 1000)
    assert hit_tokens(0, 1000, C) == 0
    assert hit_tokens(2, 1000, C) == 512
    assert hit_tokens(4, 1000, C) == 1000


def test_savable_end_only_complete_chunks():
    assert savable_end(1000, 255, C) == 0
    assert savable_end(1000, 256, C) == 256
    assert savable_end(1000, 999, C) == 768  # the partial last chunk waits for the whole prompt
    assert savable_end(1000, 1000, C) == 1000
    assert savable_end(17, 17, C) == 17


def test_save_range_chunked_prefill_saves_each_chunk_once():
    """A 1000-token prompt in 100-token steps: every chunk stored exactly once, as soon as it is complete."""
    saved, ranges = 0, []
    for computed in range(100, 1001, 100):
        a, b = save_range(1000, computed, saved, 0, C)
        if b > a:
            ranges.append((a, b))
            saved = b
    assert ranges == [(0, 256), (256, 512), (512, 768), (768, 1000)]


def test_save_range_skips_present_chunks():
    assert save_range(600, 600, 0, 256, C) == (256, 600)  # skip_leading_tokens = present prefix
    assert save_range(600, 600, 0, 600, C) == (600, 600)  # everything present: nothing written
    assert save_range(600, 300, 0, 512, C) == (512, 512)  # skip beyond what is complete: nothing yet


def test_slots_for_maps_tokens_through_the_block_table():
    slots = slots_for([7, 2, 9], 14, 20, block_size=8)
    assert slots.tolist() == [2 * 8 + 6, 2 * 8 + 7, 9 * 8 + 0, 9 * 8 + 1, 9 * 8 + 2, 9 * 8 + 3]
    assert slots.dtype == torch.long


def test_log_lines_carry_the_numbers():
    plan = LoadPlan(600, 288, 512, C)
    assert lookup_line("r1", plan) == ("Reqid: r1, Total tokens 600, Local computed tokens: 288, "
                                       "KV hit tokens: 512, need to load: 224")
    line = load_line("r1", plan, 2_000_000, 0.5)
    assert line.startswith("Reqid: r1, Retrieved 256 tokens from token 256 (chunk-aligned; 224 needed, 32 already")
    assert "of 600 total. size: 0.0020 GB, cost 500.0 ms, throughput: 0.004 GB/s" in line
    assert save_line("r2", 256, 600, 600, 256, 10**9, 2.0) == (
        "Reqid: r2, Stored 344 tokens [256, 600) of 600 (skip_leading_tokens=256). "
        "size: 1.0000 GB, cost 2000.0 ms, throughput: 0.500 GB/s")
