"""The compiled bf16 prompt attention (kernels/cpu_prefill_attention.py) against the torch reference.

Every case runs on the source's two levels: AVX512_BF16 (the dot instruction) and AVX-512 without it
(x86-64-v4: the instruction's products by FMAs); a level this CPU (or the PDSERVE_CPU_ISA cap) lacks
skips with a reason, and each build is checked to target its level. On every CPU a build without AVX-512
must say it cannot run and refuse calls, and the CPU backend must then keep torch's attention. Cases:
GQA groups 1, 3, 4 and 8; head dims 64 and 128; prompt lengths 1, around the kernel's 16-position items
and 64-key tiles, and several items long; query, key and value rows as views of one fused projection;
chunks over cached history (1 to 70 query rows after 0 to 300 cached tokens) read from a paged cache
through scattered block tables.
"""
from __future__ import annotations

import pytest
import torch

from pdserve.kernels import torch_ref
from pdserve.kernels.cpu_prefill_attention import SOURCE, CpuPrefillAttention
from tests.helpers.kernels import LEVELS, built_level, count_calls, level_params, require, runs

SHAPES = [(4, 4, 64, 1), (8, 2, 64, 15), (8, 2, 64, 16), (8, 2, 64, 17), (12, 4, 64, 63), (12, 4, 64, 65),
          (16, 2, 64, 100), (8, 1, 128, 257), (32, 8, 128, 64), (6, 2, 64, 600)]


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kernels")


@pytest.fixture(scope="module", params=level_params("avx512_bf16", "avx512"))
def kernel(request, build_dir) -> CpuPrefillAttention:
    """The build at one level, or a skip; its flags must target that level (the dot instruction or not)."""
    level = require(request.param)
    assert built_level(SOURCE, level.flags) == level.name
    k = CpuPrefillAttention(build_dir, level.flags)
    assert k.available
    return k


def _fused(length: int, heads: int, kv_heads: int, head_dim: int, seed: int):
    """q, k, v as strided views of one [length, (heads + 2 kv_heads) * head_dim] projection."""
    qkv = torch.randn(length, (heads + 2 * kv_heads) * head_dim, generator=torch.Generator().manual_seed(seed))
    qkv = qkv.bfloat16()
    q = qkv[:, :heads * head_dim].view(length, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(length, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(length, kv_heads, head_dim)
    return q, k, v


def _reference(q, k, v, scale):
    out = torch.empty(q.shape, dtype=q.dtype)
    torch_ref.attend_request(q, None, None, 0, q.shape[0], q.shape[0], scale, out, (k, v))
    return out


@pytest.mark.parametrize("heads,kv_heads,head_dim,length", SHAPES)
def test_matches_the_reference(kernel, heads, kv_heads, head_dim, length):
    q, k, v = _fused(length, heads, kv_heads, head_dim, seed=length)
    assert kernel.supports(q, k, v)
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16)
    kernel(q, k, v, head_dim ** -0.5, out)
    want = _reference(q, k, v, head_dim ** -0.5)
    # Same arithmetic in another order: at most a bf16 rounding apart, almost everywhere equal.
    torch.testing.assert_close(out, want, atol=2e-2, rtol=0)
    assert (out.float() - want.float()).abs().mean() < 1e-3


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 64), (4, 4, 128)])
@pytest.mark.parametrize("cached,chunk", [(0, 20), (15, 1), (16, 17), (100, 70), (300, 33)])
def test_chunk_over_paged_history_matches_the_reference(kernel, heads, kv_heads, head_dim, cached, chunk):
    block = 16
    seq_len = cached + chunk
    gen = torch.Generator().manual_seed(seq_len)
    num_blocks = -(-seq_len // block)
    cache = torch.randn(2, num_blocks + 7, block, kv_heads, head_dim, generator=gen).bfloat16()
    table = torch.randperm(num_blocks + 7, generator=gen)[:num_blocks + 2].to(torch.int32)  # scattered, spare
    q = _fused(chunk, heads, kv_heads, head_dim, seed=cached)[0]
    assert kernel.supports_paged(q, cache)
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16)
    kernel.paged(q, cache, table, seq_len, head_dim ** -0.5, out)
    want = torch.empty(q.shape, dtype=torch.bfloat16)
    torch_ref.attend_request(q, cache, table, 0, chunk, seq_len, head_dim ** -0.5, want)
    torch.testing.assert_close(out, want, atol=2e-2, rtol=0)
    assert (out.float() - want.float()).abs().mean() < 1e-3


def test_paged_refuses_a_table_that_does_not_fit(kernel):
    cache = torch.zeros(2, 4, 16, 2, 64, dtype=torch.bfloat16)
    q = torch.zeros(3, 4, 64, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    with pytest.raises(ValueError):
        kernel.paged(q, cache, torch.tensor([0, 1], dtype=torch.int32), 40, 0.125, out)  # 40 tokens need 3 blocks
    with pytest.raises(IndexError):
        kernel.paged(q, cache, torch.tensor([0, 4], dtype=torch.int32), 20, 0.125, out)  # no block 4


def test_each_row_attends_only_to_its_past(kernel):
    """Changing the keys and values of positions > i leaves rows <= i bit for bit the same."""
    q, k, v = _fused(70, 8, 2, 64, seed=3)
    first = torch.empty(q.shape, dtype=torch.bfloat16)
    kernel(q, k, v, 0.125, first)
    k2, v2 = k.clone(), v.clone()
    k2[40:] = torch.randn(30, 2, 64).bfloat16()
    v2[40:] = torch.randn(30, 2, 64).bfloat16()
    second = torch.empty(q.shape, dtype=torch.bfloat16)
    kernel(q, k2, v2, 0.125, second)
    assert torch.equal(first[:40], second[:40]) and not torch.equal(first[40:], second[40:])


def test_refuses_what_it_cannot_take(kernel):
    q, k, v = _fused(8, 4, 2, 64, seed=1)
    assert not kernel.supports(q.float(), k.float(), v.float())
    q32, k32, v32 = _fused(8, 4, 2, 32, seed=1)  # head_dim not a multiple of 64
    assert not kernel.supports(q32, k32, v32)
    assert not kernel.supports(q.transpose(0, 1).contiguous().transpose(0, 1), k, v)  # heads not dense


def test_a_build_without_avx512_says_so(build_dir):
    """As on a Zen 3 (x86-64-v3; on other architectures, as it is): it compiles, reports it cannot run and
    refuses."""
    k = CpuPrefillAttention(build_dir, LEVELS["avx2"].flags)
    assert k.available is False
    q, kk, v = _fused(4, 2, 1, 64, seed=2)
    assert not k.supports(q, kk, v)
    with pytest.raises(RuntimeError, match="AVX512_BF16"):
        k(q, kk, v, 0.125, torch.empty(q.shape, dtype=torch.bfloat16))


def test_backend_takes_it_for_bf16_prefill_chunks(monkeypatch):
    """A bf16 batch of decodes, a chunk over cached history and a fresh prompt through the cpu backend:
    where the CPU (under the cap) has AVX-512 the chunk goes through `paged` and the fresh prompt through the
    new-rows entry (once each; decodes never), elsewhere neither; every output row agrees with the torch
    reference backend."""
    from pdserve.engine.attention import build_attention_metadata, select_attention_backend

    heads, kv_heads, dim, block = 8, 2, 64, 16
    lens, q_lens = [40, 70, 33], [1, 30, 33]
    tables = torch.tensor([[3, 9, 4, 0, 0], [10, 2, 8, 5, 11], [6, 12, 1, 0, 0]], dtype=torch.int32)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    positions = torch.cat([torch.arange(s - n, s) for s, n in zip(lens, q_lens)])
    owner = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(q_lens))
    meta = build_attention_metadata(starts, lens, tables, tables[owner, positions // block].long() * block
                                    + positions % block)
    q, k, v = _fused(starts[-1], heads, kv_heads, dim, seed=9)
    cache = torch.randn(2, 13, block, kv_heads, dim, generator=torch.Generator().manual_seed(4)).bfloat16()
    cpu = select_attention_backend(torch.device("cpu"), "cpu")
    calls = count_calls([(CpuPrefillAttention, "__call__"), (CpuPrefillAttention, "paged")], monkeypatch.setattr)
    got = cpu.forward(q, k, v, cache.clone(), meta, dim ** -0.5)
    assert cpu.prefill_kernel.available is runs("avx512")  # the backend's own build, for this CPU and cap
    taken = 1 if runs("avx512") else 0
    assert calls.get("__call__", 0) == taken and calls.get("paged", 0) == taken
    want = select_attention_backend(torch.device("cpu"), "torch").forward(q, k, v, cache.clone(), meta, dim ** -0.5)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=0)
