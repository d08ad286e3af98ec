"""Every Triton kernel compiled for the real GPU, against the torch reference on the same CUDA tensors.

The same shapes as the interpreter suite (tests/kernels/test_triton.py) plus what only a GPU makes
affordable: long contexts through the split-KV decode path and multi-thousand-token prefixes.
"""
from __future__ import annotations

import pytest
import torch

from pdserve.engine.attention import build_attention_metadata, select_attention_backend
from pdserve.kernels import torch_ref, triton_attention, triton_transfer
from pdserve.kernels.triton_attention import num_kv_splits
from tests.kernels.test_triton import ATTN_CASES, ATTN_TOL, DTYPES, paged_batch

CUDA = torch.device("cuda")


def cuda_batch(*args):
    return tuple(t.to(CUDA) if isinstance(t, torch.Tensor) else t for t in paged_batch(*args))


def reference(query, cache, tables, qsl, seq_lens):
    return torch_ref.paged_attention(query.float(), cache.float(), tables, qsl, seq_lens, query.shape[-1] ** -0.5)


def test_auto_backend_on_cuda_is_compiled_triton():
    backend = select_attention_backend(CUDA)
    assert backend.name == "triton" and backend.num_sms > 1
    from triton.runtime.jit import JITFunction

    assert isinstance(triton_attention._paged_attention_kernel, JITFunction)  # compiled, not interpreted


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,kv_heads,head_dim", [(16, 1, 64), (32, 2, 80), (16, 8, 128)])
def test_reshape_and_cache_and_transfers(dtype, block_size, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(block_size + head_dim)
    n = 300
    caches = [torch.randn(2, 40, block_size, kv_heads, head_dim, generator=gen).to(dtype).to(CUDA) for _ in range(3)]
    key = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype).to(CUDA)
    slots = torch.randperm(40 * block_size, generator=gen)[:n].to(CUDA)
    slots[[0, 7]] = -1
    expected, actual = caches[0].clone(), caches[0].clone()
    torch_ref.reshape_and_cache(key, key * 2, expected, slots)
    triton_transfer.reshape_and_cache(key, key * 2, actual, slots)
    assert torch.equal(actual, expected)
    good = slots[slots >= 0]
    assert torch.equal(triton_transfer.gather_kv(caches[1], good), torch_ref.gather_kv(caches[1], good))
    buf = triton_transfer.gather_kv_layers(caches, good)
    assert torch.equal(buf, torch_ref.gather_kv_layers(caches, good))
    targets, wanted = [torch.zeros_like(c) for c in caches], [torch.zeros_like(c) for c in caches]
    triton_transfer.scatter_kv_layers(targets, good, buf)
    torch_ref.scatter_kv_layers(wanted, good, buf)
    assert all(torch.equal(t, w) for t, w in zip(targets, wanted))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ratio,block_size,head_dim", ATTN_CASES)
def test_backend_mixed_batch(ratio, block_size, head_dim, dtype):
    """Decode rows and chunked prefills in one batch, through the Triton backend, on the GPU."""
    gen = torch.Generator().manual_seed(ratio * 100 + block_size + head_dim)
    kv_heads = 2 if ratio < 8 else 1
    seq_lens = [9, 1, 3 * block_size + 5, block_size + 3, 2 * block_size, 700]
    q_lens = [1, 1, 2 * block_size, block_size + 3, block_size, 300]
    query, cache, tables, qsl, lens = cuda_batch(gen, seq_lens, q_lens, ratio * kv_heads, kv_heads, head_dim,
                                                 block_size, dtype)
    meta = build_attention_metadata(qsl.tolist(), lens.tolist(), tables,
                                    torch.full((query.shape[0],), -1, dtype=torch.long, device=CUDA))
    no_kv = torch.zeros(query.shape[0], kv_heads, head_dim, dtype=dtype, device=CUDA)
    out = select_attention_backend(CUDA).forward(query, no_kv, no_kv, cache, meta, head_dim ** -0.5)
    torch.testing.assert_close(out.float(), reference(query, cache, tables, qsl, lens), atol=ATTN_TOL[dtype],
                               rtol=ATTN_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 2, 7, 32])
def test_split_kv_decode_long_contexts(dtype, num_splits):
    gen = torch.Generator().manual_seed(num_splits)
    seq_lens = [8000, 1, 257, 4096, 3000]
    query, cache, tables, qsl, lens = cuda_batch(gen, seq_lens, [1] * len(seq_lens), 32, 8, 128, 16, dtype)
    out = triton_attention.paged_decode_attention(query, cache, tables, qsl, lens, 128 ** -0.5, num_splits=num_splits,
                                                  max_seq_len=max(seq_lens))
    torch.testing.assert_close(out.float(), reference(query, cache, tables, qsl, lens), atol=ATTN_TOL[dtype],
                               rtol=ATTN_TOL[dtype])


def test_split_policy_splits_a_lone_long_decode():
    sms = torch.cuda.get_device_properties(CUDA).multi_processor_count
    assert num_kv_splits(1, 8, 8192, sms) > 1
    assert num_kv_splits(512, 8, 8192, sms) == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_context_attention_over_a_long_paged_prefix(dtype):
    gen = torch.Generator().manual_seed(3)
    seq_lens, q_lens = [6000, 2500], [1000, 2500]
    query, cache, tables, qsl, lens = cuda_batch(gen, seq_lens, q_lens, 32, 8, 128, 16, dtype)
    out = triton_attention.context_attention(query, cache, tables, qsl, lens, 128 ** -0.5, max_query_len=2500)
    torch.testing.assert_close(out.float(), reference(query, cache, tables, qsl, lens), atol=ATTN_TOL[dtype],
                               rtol=ATTN_TOL[dtype])
