"""The compiled CPU decode-attention kernel against the torch reference, and its build cache.

Every case runs on one build per vector path of the source: plain C (-march=x86-64), AVX2 (x86-64-v3),
AVX-512 without avx512_bf16 (x86-64-v4) and with it, so that the paths this machine would not take stay
tested; a build this CPU (or the PDSERVE_CPU_ISA cap) cannot run skips, and every build is checked to
take the path it is named for (tests/helpers/kernels.py).
Cases: fp32/bf16/fp16; GQA ratios 1, 2, 3, 4, 8 and 16 (3 and 16: plain C below AVX-512); head dims
64 and 128 and, not a multiple of 32 (AVX-512: a masked last chunk), 40, 56, 72 and 80 (40 and 72: plain C
below AVX-512 for bf16); block sizes 8 and 16; lengths 1, at and around block boundaries, and past the
kernel's 256-key partitions (whose results it merges); scattered, non-contiguous block tables; a query
that is a strided view of a fused qkv projection.
"""
from __future__ import annotations

import pytest
import torch

from pdserve.kernels import torch_ref
from pdserve.kernels.cpu_attention import ISA_PATHS, SOURCE, CpuDecodeAttention
from tests.helpers.kernels import built_level, level_params, require

# Against the reference on the same (rounded) inputs.
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}
LENGTHS = [1, 15, 16, 17, 255, 256, 257, 600]


@pytest.fixture(scope="module", params=level_params(*ISA_PATHS))
def kernel(request, tmp_path_factory) -> CpuDecodeAttention:
    """The build at one level (ISA_PATHS names the source's paths by the levels), or a skip."""
    level = require(request.param)
    k = CpuDecodeAttention(tmp_path_factory.mktemp("kernels"), level.flags)
    assert k.isa == level.name, f"the {level.name} build runs the {k.isa} path"
    return k


@pytest.mark.slow  # seconds: outside make test-quick
def test_each_build_takes_its_path(kernel):
    """A build runs the path of the level its flags target (else the cases below would test one path four
    times): the library's own answer and the compiler's macros under the build's flags agree."""
    assert kernel.isa == built_level(SOURCE, kernel.extra_flags)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (4, 4, 64, 16), (8, 4, 64, 16), (12, 4, 64, 8), (16, 4, 128, 16), (16, 2, 40, 8), (8, 1, 64, 16),
    (8, 4, 40, 16), (4, 4, 72, 16), (16, 1, 64, 16), (8, 2, 80, 16), (8, 2, 56, 16)])
@pytest.mark.slow  # seconds: outside make test-quick
def test_decode_matches_reference(kernel, dtype, heads, kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(heads * 1000 + head_dim + block_size)
    batch = len(LENGTHS)
    max_blocks = -(-max(LENGTHS) // block_size)
    num_blocks = batch * max_blocks + 5
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[:batch * max_blocks].view(batch, max_blocks).to(torch.int32)
    qkv = torch.randn(batch, heads + 2 * kv_heads, head_dim, generator=gen).to(dtype)
    query = qkv[:, :heads]  # strided like the model's fused projection
    seq_lens = torch.tensor(LENGTHS, dtype=torch.int32)
    scale = head_dim ** -0.5
    assert kernel.supports(query, cache)
    expected = torch_ref.paged_attention(query, cache, tables, torch.arange(batch + 1, dtype=torch.int32), seq_lens,
                                         scale)
    out = torch.full(query.shape, float("nan"), dtype=dtype)
    kernel(query, cache, tables, seq_lens, scale, out)
    torch.testing.assert_close(out.float(), expected.float(), atol=TOL[dtype], rtol=0)


def test_only_the_given_rows_are_written(kernel):
    """Decode rows come first in a batch; the rows after them (prefill chunks) are not touched."""
    gen = torch.Generator().manual_seed(7)
    cache = torch.randn(2, 8, 16, 2, 64, generator=gen)
    query = torch.randn(5, 4, 64, generator=gen)
    out = torch.full(query.shape, -7.0)
    kernel(query, cache, torch.tensor([[3, 1], [0, 6]], dtype=torch.int32), torch.tensor([20, 5], dtype=torch.int32),
           0.125, out)
    assert torch.isfinite(out[:2]).all() and bool((out[2:] == -7.0).all())


def test_unsupported_inputs_are_refused(kernel):
    cache = torch.zeros(2, 4, 16, 2, 64)
    assert not kernel.supports(torch.zeros(3, 4, 64, dtype=torch.float64), cache.double())
    assert not kernel.supports(torch.zeros(3, 4, 64), cache.transpose(3, 4).contiguous().transpose(3, 4))
    assert not kernel.supports(torch.zeros(3, 64, 4).transpose(1, 2), cache)  # head_dim not dense
    assert not kernel.supports(torch.zeros(3, 4, 64, dtype=torch.bfloat16), cache)  # dtype mismatch


def test_backend_matches_torch_reference_on_a_mixed_batch():
    """Decodes first, then a chunk over cached history and a fresh prompt: outputs and cache writes
    equal the torch reference backend's."""
    from pdserve.engine.attention import build_attention_metadata, select_attention_backend

    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, dim, block = 8, 2, 64, 16
    lens, q_lens = [40, 17, 70, 23], [1, 1, 30, 23]  # rows: decode, decode, chunk over 40 cached, fresh
    tables = torch.tensor([[3, 9, 4, 0, 0], [7, 1, 0, 0, 0], [10, 2, 8, 5, 11], [6, 12, 0, 0, 0]], dtype=torch.int32)
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    positions = torch.cat([torch.arange(s - q, s) for s, q in zip(lens, q_lens)])
    owner = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(q_lens))
    slots = tables[owner, positions // block].long() * block + positions % block
    meta = build_attention_metadata(starts, lens, tables, slots)
    qkv = torch.randn(starts[-1], heads + 2 * kv_heads, dim, generator=gen)
    q, k, v = qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
    cache = torch.randn(2, 13, block, kv_heads, dim, generator=gen)
    ref_cache, cpu_cache = cache.clone(), cache.clone()
    cpu = select_attention_backend(torch.device("cpu"), "cpu")
    assert cpu.name == "cpu"
    expected = select_attention_backend(torch.device("cpu"), "torch").forward(q, k, v, ref_cache, meta, dim ** -0.5)
    got = cpu.forward(q, k, v, cpu_cache, meta, dim ** -0.5)
    assert torch.equal(cpu_cache, ref_cache)
    torch.testing.assert_close(got, expected, atol=TOL[torch.float32], rtol=0)


@pytest.mark.slow  # seconds: outside make test-quick
def test_engine_with_cpu_backend_matches_hf(tiny_llama):
    """The default CPU engine (this backend) is token-identical to HF through chunked prefill (a
    48-token budget), decoding and a prefill over a cached paged prefix."""
    from pdserve.serving import LLM, SamplingParams
    from tests.helpers.connector import hf_greedy, prompt

    prompts = [prompt(n, seed=7) for n in (1, 16, 17, 70)]
    expected = hf_greedy(tiny_llama, prompts, 4)
    llm = LLM(str(tiny_llama), block_size=16, kv_cache_memory="4MiB", max_num_batched_tokens=48)
    assert llm.engine.model_runner.attn_backend.name == "cpu"
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == expected
    again = llm.generate(prompts[-1:], greedy)
    assert again[0].token_ids == expected[-1] and again[0].num_cached_tokens == 64


def test_without_a_compiler_auto_falls_back_to_the_torch_reference(tmp_path, monkeypatch, caplog):
    from pdserve.engine.attention import select_attention_backend
    from pdserve.common.native_build import BuildError

    monkeypatch.setenv("CC", "/bin/false")  # a "compiler" that fails every build
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))  # no cached build to fall back on
    with caplog.at_level("WARNING"):
        assert select_attention_backend(torch.device("cpu")).name == "torch"
    assert "the CPU attention kernel unavailable (" in caplog.text and "using the torch reference" in caplog.text
    with pytest.raises(BuildError):  # named explicitly, it is an error
        select_attention_backend(torch.device("cpu"), "cpu")


def test_cache_write_matches_the_reference_and_skips_negative_slots(kernel):
    """The backend's one-call cache write: rows of strided K/V views (slices of a fused projection) land
    in their slots, slots < 0 are skipped, a slot past the cache is an error and writes nothing."""
    gen = torch.Generator().manual_seed(5)
    kv_heads, dim = 2, 32
    fused = torch.randn(6, 3 * kv_heads * dim, generator=gen).bfloat16()
    key = fused[:, kv_heads * dim:2 * kv_heads * dim].view(6, kv_heads, dim)
    value = fused[:, 2 * kv_heads * dim:].view(6, kv_heads, dim)
    cache = torch.randn(2, 4, 8, kv_heads, dim, generator=gen).bfloat16()
    slots = torch.tensor([3, -1, 31, 0, -1, 17])
    want, got = cache.clone(), cache.clone()
    torch_ref.reshape_and_cache(key, value, want, slots)
    assert kernel.write_cache(key, value, got, slots) and torch.equal(got, want)
    before = got.clone()
    with pytest.raises(IndexError):
        kernel.write_cache(key, value, got, torch.tensor([0, 1, 2, 3, 4, 32]))
    assert torch.equal(got, before)
    assert not kernel.write_cache(key.float(), value.float(), got, slots)  # not the cache's dtype
    assert not kernel.write_cache(key, value, got, slots.int())
