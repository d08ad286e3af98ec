"""The compiled bf16 linear kernels against the exact product, and the build cache behind them.

Every kernel runs in one build per level it has, whatever this machine's own: `fp32-widen` (the kernel of
CPUs without bf16 instructions) built for AVX-512F (x86-64-v4: 16-lane accumulators, 12-row tiles), for
an AVX2-only CPU (x86-64-v3, as on a Zen 3) and for baseline x86-64 (its portable C path); `bf16-dot`
built for AVX512_BF16. A level this CPU (or the PDSERVE_CPU_ISA cap) lacks skips with a reason; each
build is checked to target its level. The dot kernel built for an AVX2-only CPU must say it cannot run.
Row counts cover every register-tile height of both (1..16 rows), evened-out tiles (17, 33) and
more than one block of rows; output counts that are not a multiple of the 16-column panel leave a
partial last panel; a strided x is a view of a wider tensor.
"""
from __future__ import annotations

import pytest
import torch

from pdserve.common.native_build import BuildError, load_library
from pdserve.kernels import cpu_linear
from pdserve.kernels.cpu_linear import Bf16DotLinear, Bf16Linear
from tests.helpers.kernels import LEVELS, X86, built_level, level_param, require

AVX2_ONLY = LEVELS["avx2"].flags  # a later -march wins over FLAGS' -march=native
# Each kernel's levels: the vector paths its source has.
KERNELS = {"widen": (Bf16Linear, cpu_linear.SOURCE, ("avx512", "avx2", "c")),
           "dot": (Bf16DotLinear, cpu_linear.DOT_SOURCE, ("avx512_bf16",))}


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kernels")


@pytest.fixture(scope="module", params=[level_param(level, (name, level), f"{name}-{level}")
                                        for name, (_, _, levels) in KERNELS.items() for level in levels])
def kernel(request, build_dir):
    """One kernel built at one of its levels, or a skip where this CPU lacks the level."""
    name, level_name = request.param
    cls, source, _ = KERNELS[name]
    level = require(level_name)
    assert built_level(source, level.flags) == level.name
    k = cls(build_dir, level.flags)
    assert getattr(k, "available", True), f"the {level.name} build of {cls.__name__} cannot run"
    return k


def _pack(kernel, weight, bias):
    return type(kernel).pack(weight, bias)


def _strided(x: torch.Tensor) -> torch.Tensor:
    """x as a view with a row stride wider than its rows."""
    wide = torch.zeros(x.shape[0], x.shape[1] + 12, dtype=x.dtype)
    wide[:, 4:4 + x.shape[1]] = x
    return wide[:, 4:4 + x.shape[1]]


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 17, 33, 49, 100])
@pytest.mark.parametrize("out_features,in_features", [(50, 72), (64, 8), (33, 128)])
@pytest.mark.parametrize("bias", [False, True])
def test_exact_sums_round_to_nearest_even(kernel, rows, out_features, in_features, bias):
    """Small integers: every product and partial sum is exact in fp32 whatever the summation order,
    so the kernel must give exactly the bf16 rounding of the true result (sums above 256 need
    rounding, ties included)."""
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randint(-8, 9, (out_features, in_features), generator=g).to(torch.bfloat16)
    b = torch.randint(-300, 301, (out_features,), generator=g).to(torch.bfloat16) if bias else None
    x = _strided(torch.randint(-16, 17, (rows, in_features), generator=g).to(torch.bfloat16))
    expected = x.double() @ weight.double().T + (b.double() if bias else 0)
    assert expected.abs().max() < 2 ** 24
    y = kernel(x, _pack(kernel, weight, b))
    assert y.dtype == torch.bfloat16 and y.shape == (rows, out_features)
    assert torch.equal(y, expected.float().to(torch.bfloat16))


@pytest.mark.parametrize("rows", [1, 16, 17, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_fp32_product_rounded_to_bf16(kernel, rows, bias):
    """Random weights of a layer's scale: within fp32 summation-order error of the fp32 product."""
    g = torch.Generator().manual_seed(rows)
    weight = (torch.randn(200, 256, generator=g) * 0.05).to(torch.bfloat16)
    b = torch.randn(200, generator=g).to(torch.bfloat16) if bias else None
    x = torch.randn(rows, 256, generator=g).to(torch.bfloat16)
    expected = (x.float() @ weight.float().T + (b.float() if bias else 0)).to(torch.bfloat16)
    y = kernel(x, _pack(kernel, weight, b))
    torch.testing.assert_close(y.float(), expected.float(), atol=1e-2, rtol=1e-2)
    assert (y != expected).float().mean() < 0.01  # a differing sum order flips a rounding now and then


def test_nan_and_inf_propagate(kernel):
    weight = torch.ones(20, 16, dtype=torch.bfloat16)
    x = torch.ones(3, 16, dtype=torch.bfloat16)
    x[1, 5] = float("nan")
    x[2, 0] = float("inf")
    y = kernel(x, _pack(kernel, weight, None))
    assert torch.equal(y[0], torch.full((20,), 16.0, dtype=torch.bfloat16))
    assert y[1].isnan().all() and y[2].isposinf().all()


@pytest.mark.parametrize("rows", [40, 70])
def test_several_blocks_of_rows(kernel, rows):
    """K = 4096: a block of rows holds 16 (fp32-widen) or 32 (bf16-dot) of them, so 40 and 70 rows
    take several blocks, evened out; still exact sums (|sum| < 2**24)."""
    g = torch.Generator().manual_seed(rows)
    weight = torch.randint(-8, 9, (40, 4096), generator=g).to(torch.bfloat16)
    x = torch.randint(-16, 17, (rows, 4096), generator=g).to(torch.bfloat16)
    expected = (x.double() @ weight.double().T).float().to(torch.bfloat16)
    assert torch.equal(kernel(x, _pack(kernel, weight, None)), expected)


def test_denormal_inputs(kernel):
    """A bf16 denormal input (2**-130): the fp32-widen kernel keeps it (fp32 FMAs under the default
    MXCSR); the bf16 dot instruction reads it as zero, and so does oneDNN's packed bf16 GEMM on the
    same CPU (the same instruction), so swapping one for the other changes nothing here."""
    weight = torch.ones(32, 64, dtype=torch.bfloat16)
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    x[:, 0] = 2.0 ** -130
    x[2, 1] = 1.0
    y = kernel(x, _pack(kernel, weight, None))
    if isinstance(kernel, Bf16DotLinear):
        onednn = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(weight, 16), None,
                                                    "none", [], "")
        assert torch.equal(y[:2], torch.zeros(2, 32, dtype=torch.bfloat16)) and torch.equal(y, onednn)
    else:
        assert torch.equal(y[:2], torch.full((2, 32), 2.0 ** -130, dtype=torch.bfloat16))
    assert torch.equal(y[2], torch.ones(32, dtype=torch.bfloat16))  # 1 + 2**-130 rounds to 1 either way


def test_refuses_what_it_cannot_do(kernel):
    cls = type(kernel)
    assert not cls.supports(torch.zeros(8, 8 * cls.k_multiple + 1, dtype=torch.bfloat16))  # odd K
    assert not Bf16Linear.supports(torch.zeros(8, 60, dtype=torch.bfloat16))  # K % 8 != 0
    assert not cls.supports(torch.zeros(8, 64))  # not bf16
    packed = cls.pack(torch.zeros(8, 64, dtype=torch.bfloat16), None)
    with pytest.raises(TypeError, match="bf16"):
        kernel(torch.zeros(2, 64), packed)
    with pytest.raises(ValueError, match="x has 72 features, the weight 64"):
        kernel(torch.zeros(2, 72, dtype=torch.bfloat16), packed)
    other = (Bf16Linear if cls is Bf16DotLinear else Bf16DotLinear).pack(torch.zeros(8, 64, dtype=torch.bfloat16), None)
    with pytest.raises(ValueError, match="packed as"):
        kernel(torch.zeros(2, 64, dtype=torch.bfloat16), other)
    assert kernel(torch.zeros(0, 64, dtype=torch.bfloat16), packed).shape == (0, 8)


def test_dot_kernel_built_without_avx512_bf16_says_so(build_dir):
    """Built without AVX512_BF16 (as on a Zen 3; on other architectures, as it is), the dot kernel
    compiles, reports it cannot run and refuses calls; the engine then keeps oneDNN (or the fp32-widen
    kernel)."""
    kernel = Bf16DotLinear(build_dir, AVX2_ONLY if X86 else ())
    assert kernel.available is False
    with pytest.raises(BuildError, match="AVX512_BF16"):
        kernel(torch.ones(1, 64, dtype=torch.bfloat16), Bf16DotLinear.pack(torch.ones(8, 64, dtype=torch.bfloat16),
                                                                            None))


def test_build_is_cached_per_source(tmp_path):
    """A second load reuses the library; a changed source gets a build of its own."""
    src = tmp_path / "one.c"
    src.write_text("int pd_answer(void) { return 42; }\n")
    build = tmp_path / "build"
    assert load_library(src, build).pd_answer() == 42
    first = sorted(build.glob("*.so"))
    assert len(first) == 1
    mtime = first[0].stat().st_mtime_ns
    assert load_library(src, build).pd_answer() == 42
    assert sorted(build.glob("*.so")) == first and first[0].stat().st_mtime_ns == mtime
    src.write_text("int pd_answer(void) { return 43; }\n")
    assert load_library(src, build).pd_answer() == 43
    assert len(list(build.glob("*.so"))) == 2


@pytest.mark.slow
def test_benchmark_script_runs():
    """benchmarks/linear_kernels.py at a toy size (its figures mean nothing here): both tables come out."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "linear_kernels.py"
    out = subprocess.run([sys.executable, str(script), "--rows", "1", "7", "--shapes", "40x64", "--iters", "1",
                          "--repeats", "1", "--weight-mib", "0", "--layers", "1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    rows = [line for line in lines if line.startswith("| 40x64 |")]
    assert len(rows) == 2 and "x |" in rows[1]
    step = lines[lines.index(next(line for line in lines if "4 calls" in line)) + 3:]
    assert [line.split(" | ")[0] for line in step] == ["| 1", "| 7"] and all(line.endswith("x |") for line in step)


def test_a_source_carries_its_recipe(tmp_path):
    """The files a source includes are part of its build's key (a changed header rebuilds), and its
    PD_CFLAGS line adds flags."""
    src, header = tmp_path / "one.c", tmp_path / "answer.h"
    src.write_text('/* PD_CFLAGS: -DPD_BASE=40 */\n#include "answer.h"\n'
                   'int pd_answer(void) { return PD_BASE + ANSWER; }\n')
    header.write_text("#define ANSWER 2\n")
    build = tmp_path / "build"
    assert load_library(src, build).pd_answer() == 42
    header.write_text("#define ANSWER 3\n")
    assert load_library(src, build).pd_answer() == 43
    assert len(list(build.glob("*.so"))) == 2


def test_without_a_compiler_the_library_prebuilt_for_this_cpu_loads(tmp_path, monkeypatch):
    """What an image without a compiler runs: the libraries `--prebuild` made for every x86-64 level; of
    those this CPU runs, the widest. A changed source finds none (the prebuilt key is its text and flags)."""
    from pdserve.common.native_build import TARGETS, loaded_libraries, prebuild, runnable_targets

    src = tmp_path / "pd_prebuilt_probe.c"
    src.write_text("int pd_answer(void) { return 42; }\n")
    prebuilt = tmp_path / "prebuilt"
    built = prebuild(prebuilt, [src])
    assert len(built) == len(TARGETS) >= 4
    assert all(path.stat().st_mode & 0o777 == 0o644 for path in built)  # an image's unprivileged user reads them
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert load_library(src, tmp_path / "cache", prebuilt_dir=prebuilt).pd_answer() == 42
    widest = runnable_targets()[0]
    assert loaded_libraries()["pd_prebuilt_probe"].startswith(f"prebuilt for {widest.name}: {prebuilt}/")
    assert not (tmp_path / "cache").exists()
    src.write_text("int pd_answer(void) { return 43; }\n")
    with pytest.raises(BuildError, match="does not run.*no library prebuilt for this CPU"):
        load_library(src, tmp_path / "cache", prebuilt_dir=prebuilt)
