"""The compiled elementwise block steps (kernels/cpu_block_ops.py) against the torch reference
(engine/models/block_ops.py), on one build of the same source per level: plain C (-march=x86-64),
AVX2, AVX-512 (plain loops that each build vectorizes its own way) and AVX512_BF16 (bf16 rows take the
16-lane conversions of kernels/csrc/bf16.h); a level this CPU (or the PDSERVE_CPU_ISA cap) lacks skips.

Exactness, as the C source's header states it: the residual sum and RoPE equal the reference bit for
bit; RMSNorm and SiLU-and-multiply within a few fp32 ulps or one bf16 ulp, and mostly equal (the sum of
squares is added in another order; SiLU has its own exp).
"""
from __future__ import annotations

import pytest
import torch

from pdserve.engine.models import block_ops
from pdserve.kernels.cpu_block_ops import SOURCE, CpuBlockOps
from pdserve.kernels.ops import use_backend
from tests.helpers.kernels import LEVELS, built_level, level_params, require

DTYPES = [torch.float32, torch.bfloat16]
ULP = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -7}


@pytest.fixture(scope="module", params=level_params("c", "avx2", "avx512", "avx512_bf16"))
def ops(request, tmp_path_factory) -> CpuBlockOps:
    """The build at one level, or a skip; its flags must target that level (no build passes for another)."""
    level = require(request.param)
    assert built_level(SOURCE, level.flags) == level.name
    return CpuBlockOps(tmp_path_factory.mktemp("kernels"), level.flags)


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def _within_ulps(got: torch.Tensor, want: torch.Tensor, ulps: float) -> None:
    bound = ulps * ULP[want.dtype] * want.float().abs() + 1e-37
    assert ((got.float() - want.float()).abs() <= bound).all(), ((got.float() - want.float()).abs() / bound).max()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (16, 1024), (7, 1000), (300, 2048)])  # 300 x 2048: threads
def test_add_rms_norm(ops, dtype, rows, hidden):
    x, res = _randn(rows, hidden, dtype=dtype, seed=1), _randn(rows, hidden, dtype=dtype, seed=2, scale=3)
    weight = (torch.rand(hidden, generator=torch.Generator().manual_seed(3)) + 0.5).to(dtype)
    want_sum = res + x
    want = block_ops.rms_norm_ref(want_sum, weight, 1e-5)
    stream = res.clone()
    got, got_sum = ops.add_rms_norm(x, stream, weight, 1e-5)
    assert got_sum.data_ptr() == stream.data_ptr() and torch.equal(got_sum, want_sum)
    first, same = ops.add_rms_norm(x, None, weight, 1e-5)  # the first layer: no residual yet
    assert same is x
    for out, ref in ((got, want), (first, block_ops.rms_norm_ref(x, weight, 1e-5))):
        # An ulp of the mean, through rsqrt and two products (fp32); in bf16 it rarely moves a rounding.
        _within_ulps(out, ref, 4 if dtype == torch.float32 else 1)
        assert (out == ref).float().mean() > (0.999 if dtype == torch.bfloat16 else 0.3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim", [(6, 64), (3, 128), (2, 32), (5, 6)])
def test_rope_is_bit_exact_on_a_strided_qkv_slice(ops, dtype, heads, head_dim):
    rows = 9
    qkv = _randn(rows, heads * head_dim + 2 * head_dim, dtype=dtype, seed=4)
    x = qkv[:, :heads * head_dim].view(rows, heads, head_dim)  # rows strided, heads dense
    cos, sin = _randn(rows, head_dim, dtype=dtype, seed=5), _randn(rows, head_dim, dtype=dtype, seed=6)
    assert torch.equal(ops.rope(x, cos, sin), block_ops.rope_ref(x, cos, sin))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 40), (16, 2816), (64, 4096)])  # 64 x 4096: threads
def test_silu_mul(ops, dtype, rows, inter):
    gate_up = _randn(rows, 2 * inter, dtype=dtype, seed=7, scale=4)
    gate_up[0, :6] = torch.tensor([-100.0, -89.0, -20.0, 0.0, 20.0, 100.0])  # exp's clamps and both tails
    got, want = ops.silu_mul(gate_up), block_ops.silu_mul_ref(gate_up)
    _within_ulps(got, want, 4 if dtype == torch.float32 else 1)
    assert (got == want).float().mean() > (0.99 if dtype == torch.bfloat16 else 0.8)
    assert got[0, 0] == 0 and got[0, 3] == 0


def test_refuses_what_it_cannot_take(ops):
    half = torch.randn(4, 64).half()
    assert ops.add_rms_norm(half, None, torch.ones(64).half(), 1e-5) is None
    assert ops.silu_mul(half) is None
    wide = torch.randn(4, 128)
    assert ops.add_rms_norm(wide[:, ::2], None, torch.ones(64), 1e-5) is None  # columns strided
    assert ops.add_rms_norm(wide[:, :64], None, torch.ones(64), 1e-5) is None  # rows not dense
    assert ops.add_rms_norm(wide, torch.randn(4, 128).double(), torch.ones(128), 1e-5) is None
    x = torch.randn(4, 2, 8)
    assert ops.rope(x.transpose(0, 1).contiguous().transpose(0, 1), torch.randn(4, 8), torch.randn(4, 8)) is None
    assert ops.rope(x, torch.randn(4, 8).bfloat16(), torch.randn(4, 8).bfloat16()) is None
    assert ops.silu_mul(torch.randn(3, 5)) is None  # odd width: no gate/up halves


def test_dispatch_uses_the_compiled_kernels_unless_torch_is_forced():
    """The model's calls go through the kernels on CPU (the residual stream is updated in place) and
    through the out-of-place torch reference under PDSERVE_KERNELS=torch."""
    x, weight = torch.randn(3, 64), torch.rand(64) + 0.5
    stream = torch.randn(3, 64)
    _, summed = block_ops.add_rms_norm(x, stream, weight, 1e-6)
    assert summed.data_ptr() == stream.data_ptr()
    stream = torch.randn(3, 64)
    before = stream.clone()
    with use_backend("torch"):
        _, summed = block_ops.add_rms_norm(x, stream, weight, 1e-6)
    assert summed.data_ptr() != stream.data_ptr() and torch.equal(stream, before)
    assert torch.equal(summed, before + x)


def test_engine_with_torch_block_ops_matches_hf(tiny_llama, monkeypatch):
    """The reference path the kernels are checked against is itself token-identical to HF (the default
    path is checked in tests/engine/test_models.py and throughout)."""
    from pdserve.serving import LLM, SamplingParams
    from tests.helpers.connector import hf_greedy, prompt

    monkeypatch.setenv("PDSERVE_KERNELS", "torch")
    prompts = [prompt(n, seed=5) for n in (3, 33)]
    llm = LLM(str(tiny_llama), block_size=16, kv_cache_memory="4MiB")
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == hf_greedy(tiny_llama, prompts, 4)


def test_a_machine_without_a_working_compiler_gets_none_and_one_warning(tmp_path, monkeypatch, caplog):
    """common/native_build.py's build_or_none, as every compiled path's first use calls it: the caller
    falls back, with one warning per reason however many libraries fail for it, one build attempt per
    name and process, and nothing built or logged at all under PDSERVE_KERNELS=torch."""
    from pdserve.common.native_build import build_or_none

    tag = str(tmp_path)  # names of this test's own: build_or_none remembers each answer for the process
    calls = []

    def make(build_dir):
        calls.append(build_dir)
        return CpuBlockOps(build_dir)

    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with caplog.at_level("INFO", logger="pdserve.common.native_build"):
        got = build_or_none(f"block ops {tag}", lambda: make(tmp_path / "a"), "torch ops instead")
        other = build_or_none(f"other ops {tag}", lambda: make(tmp_path / "b"), "torch ops too")
        again = build_or_none(f"block ops {tag}", lambda: make(tmp_path / "c"), "-")
    assert got is None and other is None and again is None and len(calls) == 2
    records = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in records] == ["WARNING", "INFO"]
    assert records[0][1].startswith(f"block ops {tag} unavailable (compiler ")
    assert records[0][1].endswith("no library prebuilt for this CPU); torch ops instead")
    assert records[1][1].startswith(f"other ops {tag} unavailable (compiler ")
    monkeypatch.delenv("CC")
    monkeypatch.setenv("PDSERVE_KERNELS", "torch")
    assert build_or_none(f"new ops {tag}", lambda: make(tmp_path / "d"), "-") is None and len(calls) == 2
    monkeypatch.delenv("PDSERVE_KERNELS")
    assert build_or_none(f"new ops {tag}", lambda: make(tmp_path / "d"), "-") is not None and len(calls) == 3


def test_a_missing_source_is_one_warning_and_the_torch_path(tmp_path, monkeypatch, caplog):
    """An installation whose C sources are gone (a wheel built without its package data) falls back like a
    machine without a compiler, instead of failing the engine's start with FileNotFoundError."""
    from pdserve.common.native_build import BuildError, build_or_none, load_library

    with pytest.raises(BuildError, match="is missing"):
        load_library(tmp_path / "gone.c", tmp_path / "kernels")
    (tmp_path / "main.c").write_text('#include "gone.h"\nint pd_answer(void) { return 42; }\n')
    with pytest.raises(BuildError, match="gone.h is missing"):
        load_library(tmp_path / "main.c", tmp_path / "kernels")
    with caplog.at_level("WARNING", logger="pdserve.common.native_build"):
        assert build_or_none(f"gone {tmp_path}", lambda: load_library(tmp_path / "gone.c"), "torch ops") is None
    assert "gone.c is missing" in caplog.text and "; torch ops" in caplog.text


@pytest.fixture()
def bf16_and_plain(tmp_path) -> tuple[CpuBlockOps, CpuBlockOps]:
    """The AVX512_BF16 build (what -march=native gives a CPU with the instruction) and the AVX-512 one without
    it: they differ in the instruction only. On a CPU without it they would be one build compared with
    itself, so the case skips there."""
    bf16, avx512 = require("avx512_bf16"), LEVELS["avx512"]
    assert (built_level(SOURCE, bf16.flags), built_level(SOURCE, avx512.flags)) == ("avx512_bf16", "avx512")
    return CpuBlockOps(tmp_path / "native", bf16.flags), CpuBlockOps(tmp_path / "plain", avx512.flags)


@pytest.mark.kernel_level("avx512_bf16")
def test_native_bf16_conversions_equal_the_integer_rounding_bit_for_bit(bf16_and_plain):
    """Where the build has AVX512_BF16, bf16 rows take the 16-lane paths of kernels/csrc/bf16.h
    (vcvtneps2bf16, which flushes fp32 denormals: those vectors take the integer path); a build without
    the instruction runs the plain loops. Both must store the same bits, denormals, NaN, infinities,
    signed zeros, exp's clamps and row tails included."""
    native, plain = bf16_and_plain
    specials = torch.tensor([1e-39, -2e-40, float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 3e-38])

    def data(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
        t = _randn(*shape, dtype=torch.float32, seed=seed, scale=scale)
        t.view(-1)[:8] = specials
        return t.bfloat16()

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return torch.equal(a.view(torch.int16), b.view(torch.int16))

    for rows, hidden in [(16, 1024), (3, 1037)]:
        x, res, w = data(rows, hidden, seed=1), data(rows, hidden, seed=2, scale=3), data(hidden, seed=3) + 1
        ra, rb = res.clone(), res.clone()
        assert same(native.add_rms_norm(x, ra, w, 1e-5)[0], plain.add_rms_norm(x, rb, w, 1e-5)[0]) and same(ra, rb)
        assert same(native.add_rms_norm(x, None, w, 1e-5)[0], plain.add_rms_norm(x, None, w, 1e-5)[0])
    for heads, head_dim in [(6, 64), (4, 96), (5, 6)]:
        qkv = data(9, heads * head_dim + 2 * head_dim, seed=4)
        x = qkv[:, :heads * head_dim].view(9, heads, head_dim)
        cos, sin = data(9, head_dim, seed=5), data(9, head_dim, seed=6)
        assert same(native.rope(x, cos, sin), plain.rope(x, cos, sin))
    for rows, inter in [(16, 2816), (5, 1001)]:
        gate_up = data(rows, 2 * inter, seed=7, scale=4)
        gate_up[0, 8:14] = torch.tensor([-100.0, -89.0, -88.0, -87.9, 88.5, 100.0])
        assert same(native.silu_mul(gate_up), plain.silu_mul(gate_up))
