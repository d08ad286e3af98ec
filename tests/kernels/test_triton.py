"""Every Triton kernel, run in Triton's interpreter on CPU, against the torch reference.

Shapes are random but seeded per case: GQA ratios 1/2/4/8, block sizes 16/32, head dims
32/64/80/96/128, fp32/fp16/bf16, ragged lengths that include 1 and block boundaries.
Attention goes through the Triton attention backend (engine/attention), as the engine calls it.
"""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from pdserve.engine.attention import build_attention_metadata
from pdserve.engine.attention.backends.triton import TritonAttentionBackend
from pdserve.kernels import ops, torch_ref
from tests.helpers.kernels import count_calls

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Attention tolerances against the fp32 reference on the same (rounded) inputs.
ATTN_TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module", autouse=True)
def triton_interpreter() -> Iterator[None]:
    """Force the Triton path; tests/conftest.py set TRITON_INTERPRET=1 before triton was imported."""
    from triton.runtime.interpreter import InterpretedFunction

    from pdserve.kernels import triton_attention, triton_transfer

    assert isinstance(triton_attention._paged_attention_kernel, InterpretedFunction)
    assert isinstance(triton_transfer._kv_slot_copy_kernel, InterpretedFunction)
    with ops.use_backend("triton"):
        yield


@pytest.fixture(scope="module")
def backend() -> TritonAttentionBackend:
    return TritonAttentionBackend(torch.device("cpu"))


def make_cache(gen: torch.Generator, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
               dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)


def random_slots(gen: torch.Generator, n: int, num_slots: int) -> torch.Tensor:
    return torch.randperm(num_slots, generator=gen)[:n]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,kv_heads,head_dim", [(16, 1, 64), (32, 2, 80), (16, 4, 128)])
def test_reshape_and_cache(dtype: torch.dtype, block_size: int, kv_heads: int, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(block_size * kv_heads + head_dim)
    n, num_heads = 37, 2 * kv_heads
    cache = make_cache(gen, 8, block_size, kv_heads, head_dim, dtype)
    # key/value as the model produces them: strided views into one fused qkv projection
    qkv = torch.randn(n, num_heads + 2 * kv_heads, head_dim, generator=gen).to(dtype)
    key, value = qkv[:, num_heads:num_heads + kv_heads], qkv[:, num_heads + kv_heads:]
    slots = random_slots(gen, n, cache.shape[1] * block_size)
    slots[[0, 5, n - 1]] = -1  # padding tokens are skipped
    expected, actual = cache.clone(), cache.clone()
    torch_ref.reshape_and_cache(key, value, expected, slots)
    from pdserve.kernels import triton_transfer

    triton_transfer.reshape_and_cache(key, value, actual, slots)
    assert not torch.equal(expected, cache)
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_layers", [1, 3])
def test_gather_scatter_kv(dtype: torch.dtype, num_layers: int) -> None:
    gen = torch.Generator().manual_seed(num_layers)
    block_size, kv_heads, head_dim = 16, 2, 96
    caches = [make_cache(gen, 6, block_size, kv_heads, head_dim, dtype) for _ in range(num_layers)]
    slots = random_slots(gen, 33, 6 * block_size)

    buf = ops.gather_kv_layers(caches, slots)
    assert buf.shape == (num_layers, 2, 33, kv_heads, head_dim)
    assert torch.equal(buf, torch_ref.gather_kv_layers(caches, slots))
    for cache in caches:
        assert torch.equal(ops.gather_kv(cache, slots), torch_ref.gather_kv(cache, slots))

    targets = [torch.zeros_like(c) for c in caches]
    expected = [torch.zeros_like(c) for c in caches]
    dest = random_slots(gen, 33, 6 * block_size)
    ops.scatter_kv_layers(targets, dest, buf)
    torch_ref.scatter_kv_layers(expected, dest, buf)
    assert all(torch.equal(t, e) for t, e in zip(targets, expected))
    single, single_expected = torch.zeros_like(caches[0]), torch.zeros_like(caches[0])
    ops.scatter_kv(single, dest, buf[0])
    torch_ref.scatter_kv(single_expected, dest, buf[0])
    assert torch.equal(single, single_expected) and single.abs().sum() > 0


def test_transfer_rejects_mismatched_layers() -> None:
    a = torch.zeros(2, 4, 16, 2, 64)
    with pytest.raises(ValueError, match="share shape"):
        ops.gather_kv_layers([a, torch.zeros(2, 5, 16, 2, 64)], torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="layers"):
        ops.scatter_kv_layers([a], torch.tensor([0, 1]), torch.zeros(2, 2, 2, 2, 64))


def paged_batch(gen: torch.Generator, seq_lens: list[int], q_lens: list[int], num_heads: int, kv_heads: int,
                head_dim: int, block_size: int, dtype: torch.dtype):
    """A ragged batch over a shuffled paged cache, with a padded block table like the runner's
    (single-token requests first, as the runner orders them)."""
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    cache = make_cache(gen, num_blocks, block_size, kv_heads, head_dim, dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq) + 1, dtype=torch.int32)
    used = 0
    for b, nb in enumerate(blocks_per_seq):
        block_tables[b, :nb] = perm[used:used + nb]
        used += nb
    query_start_loc = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(q_lens).cumsum(0)
    # the query as the model produces it: a strided view into a fused qkv projection
    qkv = torch.randn(sum(q_lens), num_heads + 2 * kv_heads, head_dim, generator=gen).to(dtype)
    return qkv[:, :num_heads], cache, block_tables, query_start_loc, torch.tensor(seq_lens, dtype=torch.int32)


def check_attention(backend, query, cache, block_tables, query_start_loc, seq_lens, dtype) -> None:
    """The backend's output (its cache write skipped: every slot is -1) against the fp32 reference."""
    scale = query.shape[-1] ** -0.5
    expected = torch_ref.paged_attention(query.float(), cache.float(), block_tables, query_start_loc, seq_lens,
                                         scale)
    n, kv_heads = query.shape[0], cache.shape[3]
    meta = build_attention_metadata(query_start_loc.tolist(), seq_lens.tolist(), block_tables,
                                    torch.full((n,), -1, dtype=torch.long))
    no_kv = torch.zeros(n, kv_heads, query.shape[2], dtype=dtype)
    before = cache.clone()
    actual = backend.forward(query, no_kv, no_kv, cache, meta, scale)
    assert torch.equal(cache, before)
    assert actual.dtype == dtype and actual.shape == query.shape
    torch.testing.assert_close(actual.float(), expected, atol=ATTN_TOL[dtype], rtol=ATTN_TOL[dtype])


ATTN_CASES = [  # (gqa ratio, block size, head dim): every ratio meets both block sizes
    (1, 16, 64), (1, 32, 96), (2, 16, 80), (2, 32, 128), (4, 16, 128), (4, 32, 64), (8, 16, 32), (8, 32, 80),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ratio,block_size,head_dim", ATTN_CASES)
@pytest.mark.slow  # seconds: outside make test-quick
def test_decode_attention(ratio: int, block_size: int, head_dim: int, dtype: torch.dtype, backend,
                          monkeypatch: pytest.MonkeyPatch) -> None:
    from pdserve.kernels import triton_attention

    decode_calls = count_calls([(triton_attention, "paged_decode_attention")], monkeypatch.setattr)
    gen = torch.Generator().manual_seed(ratio * 1000 + block_size + head_dim)
    kv_heads = 2 if ratio < 8 else 1
    extra = torch.randint(2, 3 * block_size, (2,), generator=gen).tolist()
    seq_lens = [1, block_size, block_size + 1, 2 * block_size] + extra
    batch = paged_batch(gen, seq_lens, [1] * len(seq_lens), ratio * kv_heads, kv_heads, head_dim, block_size, dtype)
    check_attention(backend, *batch, dtype)
    assert decode_calls == {"paged_decode_attention": 1}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ratio,block_size,head_dim", ATTN_CASES)
@pytest.mark.slow  # seconds: outside make test-quick
def test_context_attention(ratio: int, block_size: int, head_dim: int, dtype: torch.dtype, backend,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    from pdserve.kernels import triton_attention

    calls = count_calls([(triton_attention, "context_attention"), (triton_attention, "paged_decode_attention")],
                        monkeypatch.setattr)
    gen = torch.Generator().manual_seed(ratio * 1000 + block_size + head_dim + 1)
    kv_heads = 2 if ratio < 8 else 1
    # a decode token and a one-token prompt (the decode kernel), then a full prefill, a chunk over a
    # cached prefix ending on a block boundary and a random chunk (the context kernel), one batch
    n = int(torch.randint(block_size + 3, 3 * block_size, (1,), generator=gen))  # the chunk has >= 2 tokens
    seq_lens = [9, 1, block_size + 3, 2 * block_size, n]
    q_lens = [1, 1, block_size + 3, block_size, n - block_size - 1]
    batch = paged_batch(gen, seq_lens, q_lens, ratio * kv_heads, kv_heads, head_dim, block_size, dtype)
    check_attention(backend, *batch, dtype)
    assert calls == {"context_attention": 1, "paged_decode_attention": 1}


def test_context_kernel_alone_takes_single_token_rows() -> None:
    """The context kernel is correct on any ragged batch, single-token rows anywhere included."""
    from pdserve.kernels import triton_attention

    gen = torch.Generator().manual_seed(11)
    query, cache, tables, qsl, seq_lens = paged_batch(gen, [20, 9, 33], [20, 1, 5], 4, 2, 32, 16, torch.float32)
    scale = 32 ** -0.5
    expected = torch_ref.paged_attention(query, cache, tables, qsl, seq_lens, scale)
    actual = triton_attention.context_attention(query, cache, tables, qsl, seq_lens, scale, max_query_len=20)
    torch.testing.assert_close(actual, expected, atol=ATTN_TOL[torch.float32], rtol=ATTN_TOL[torch.float32])


def test_attention_long_query_spans_several_tiles(backend) -> None:
    """More query tokens than one program's tile, and an empty request in the batch."""
    gen = torch.Generator().manual_seed(7)
    batch = paged_batch(gen, [150, 70, 40], [150, 0, 17], 2, 2, 64, 16, torch.float32)
    check_attention(backend, *batch, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [2, 3])
@pytest.mark.slow  # seconds: outside make test-quick
def test_split_kv_decode_matches_reference(dtype: torch.dtype, num_splits: int) -> None:
    """Flash-decoding: keys split into slices (one of them empty with 3 splits of 64-key tiles),
    partial results combined by their log-sum-exp; sequences shorter than one slice included."""
    from pdserve.kernels import triton_attention

    gen = torch.Generator().manual_seed(num_splits)
    seq_lens = [200, 1, 64, 65, 130]
    query, cache, tables, qsl, lens = paged_batch(gen, seq_lens, [1] * 5, 8, 2, 64, 16, dtype)
    scale = 64 ** -0.5
    expected = torch_ref.paged_attention(query.float(), cache.float(), tables, qsl, lens, scale)
    actual = triton_attention.paged_decode_attention(query, cache, tables, qsl, lens, scale, num_splits=num_splits,
                                                     max_seq_len=max(seq_lens))
    torch.testing.assert_close(actual.float(), expected, atol=ATTN_TOL[dtype], rtol=ATTN_TOL[dtype])


def test_num_kv_splits_policy() -> None:
    from pdserve.kernels.triton_attention import num_kv_splits

    assert num_kv_splits(num_seqs=256, num_kv_heads=8, max_seq_len=32768, num_sms=132) == 1  # batch fills the GPU
    assert num_kv_splits(num_seqs=1, num_kv_heads=8, max_seq_len=200, num_sms=132) == 1  # too short to split
    assert num_kv_splits(num_seqs=1, num_kv_heads=8, max_seq_len=8192, num_sms=132) == 32  # 2 x 132 SMs / 8
    assert num_kv_splits(num_seqs=1, num_kv_heads=1, max_seq_len=131072, num_sms=132) == 64  # capped
    assert num_kv_splits(num_seqs=2, num_kv_heads=8, max_seq_len=1024, num_sms=132) == 4  # >= 256 keys each


def test_backend_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    from pdserve.kernels import triton_transfer

    calls = count_calls([(triton_transfer, "gather_kv")], monkeypatch.setattr)
    cache, slots = torch.randn(2, 2, 16, 1, 32), torch.tensor([3, 17])
    with ops.use_backend("auto"):  # CPU tensors -> the torch reference
        ops.gather_kv(cache, slots)
    assert calls == {}
    ops.gather_kv(cache, slots)  # forced by the module fixture
    assert calls == {"gather_kv": 1}
    with ops.use_backend("torch"):
        monkeypatch.setenv("PDSERVE_KERNELS", "triton")  # the context manager wins over the env
        ops.gather_kv(cache, slots)
    assert calls == {"gather_kv": 1}
    with pytest.raises(ValueError, match="unknown kernel backend 'cuda'"):
        with ops.use_backend("cuda"):
            pass


def test_bad_env_backend_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from pdserve.common import kernel_choice

    monkeypatch.setattr(kernel_choice, "_forced", [])
    monkeypatch.setenv("PDSERVE_KERNELS", "gpu")
    with pytest.raises(ValueError, match="PDSERVE_KERNELS: unknown kernel backend 'gpu'"):
        ops.gather_kv(torch.zeros(2, 1, 16, 1, 32), torch.tensor([0]))
    monkeypatch.setenv("PDSERVE_KERNELS", "triton")
    from pdserve.kernels import triton_transfer

    calls = count_calls([(triton_transfer, "gather_kv")], monkeypatch.setattr)
    ops.gather_kv(torch.zeros(2, 1, 16, 1, 32), torch.tensor([0]))
    assert calls == {"gather_kv": 1}
