"""Prefill -> KV store -> decode on one GPU (two engines in one process), over a file store and redis-server.

The decode engine computes only the last prompt token of each request; its KV arrives through the
CUDA data path (pinned staging, copy stream, per-layer events). Outputs are checked against HF on
the same GPU with the suite's near-tie rule.
"""
from __future__ import annotations

import torch

from pdserve.connectors.staging import PinnedPool, StagedTransfer
from pdserve.engine.device import Platform
from pdserve.kernels import torch_ref
from pdserve.serving import LLM, SamplingParams
from tests_gpu.helpers import count_tolerated_divergences, hf_greedy_with_gaps, prompt

LENGTHS = [1, 17, 255, 256, 257, 1000, 3000]  # chunk (256) and block (16) boundaries
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
PREFILL = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
CUDA = torch.device("cuda")


def handoff(model, store_url: str) -> None:
    prompts = [prompt(n, seed=5) for n in LENGTHS]
    tokens, gaps = hf_greedy_with_gaps(model, prompts, MAX_TOKENS)
    kw = dict(device="cuda", dtype="float32", kv_cache_memory="2GiB", kv_store=store_url, chunk_size=256)
    producer = LLM(str(model), kv_role="kv_producer", **kw)
    consumer = LLM(str(model), kv_role="kv_consumer", **kw)
    transfers = [e.engine.connector.transfer for e in (producer, consumer)]
    assert all(isinstance(t, StagedTransfer) for t in transfers)
    first = producer.generate(prompts, PREFILL)
    count_tolerated_divergences([o.token_ids for o in first], [t[:1] for t in tokens], gaps, "prefill node")
    before = consumer.engine.get_stats().num_prompt_tokens_computed
    out = consumer.generate(prompts, GREEDY)
    assert consumer.engine.get_stats().num_prompt_tokens_computed - before == len(prompts)  # KV came from the store
    assert [o.num_cached_tokens for o in out] == [n - 1 for n in LENGTHS]
    count_tolerated_divergences([o.token_ids for o in out], tokens, gaps, f"decode node over {store_url}")
    for t in transfers:
        assert t.pool.num_free == t.pool.num_allocations and t.pool.num_acquired > t.pool.num_allocations
        assert all(buf.is_pinned() for buf, _ in t.pool._free)
    producer.engine.shutdown()
    consumer.engine.shutdown()


def test_pd_over_file_store_on_one_gpu(fp32_model, tmp_path):
    handoff(fp32_model, f"file://{tmp_path}")


def test_pd_over_redis_on_one_gpu(fp32_model, redis_server):
    handoff(fp32_model, redis_server.url)


def test_staged_transfer_with_real_streams():
    """Save: gather on the compute stream, copy to pinned memory on the save stream; load: pinned -> copy
    stream -> scatter, the compute stream waiting on the load's event. Bytes exact both ways."""
    platform = Platform(CUDA)
    transfer = StagedTransfer(platform)
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 64, 16, 8, 128, generator=gen).to(torch.bfloat16).to(CUDA)
    slots = torch.randperm(64 * 16, generator=gen)[:600].to(CUDA)
    host = transfer.save(cache, slots, [256, 256, 88])
    host.ready.synchronize()
    assert all(t.is_pinned() and t.device.type == "cpu" for t in host.tensors)
    for t, lo in zip(host.tensors, (0, 256, 512)):
        assert torch.equal(t, torch_ref.gather_kv(cache, slots[lo:lo + t.shape[1]]).cpu())
    target = torch.zeros_like(cache)
    read = transfer.read_target([t.shape[1] for t in host.tensors], (8, 128), torch.bfloat16)
    for o, t in zip(read.out, host.tensors):
        o.copy_(t)
    transfer.release(host)
    transfer.begin_step()
    event = transfer.load(target, 0, 600, slots, read)
    transfer.wait(event)
    expected = torch.zeros_like(cache)
    torch_ref.scatter_kv(expected, slots, torch_ref.gather_kv(cache, slots))
    assert torch.equal(target, expected)  # read on the compute stream, after the event


def test_pinned_pool_is_pinned():
    pool = PinnedPool(Platform(CUDA))
    assert pool.acquire(100).is_pinned()
