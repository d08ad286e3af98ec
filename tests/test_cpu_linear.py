"""The compiled bf16 linear kernel against the exact product, and the build cache behind it.

The kernel runs whatever the CPU (the engine uses it only where oneDNN cannot pack bf16). Row
counts cover every register-tile height (1..6 rows) and more than one block of rows (48); output
counts that are not a multiple of the 16-column panel leave a partial last panel; a strided x
is a view of a wider tensor.
"""
from __future__ import annotations

import pytest
import torch

from kernels.cpu_build import load_library
from kernels.cpu_linear import Bf16Linear


@pytest.fixture(scope="module")
def kernel(tmp_path_factory) -> Bf16Linear:
    return Bf16Linear(tmp_path_factory.mktemp("kernels"))


def _strided(x: torch.Tensor) -> torch.Tensor:
    """x as a view with a row stride wider than its rows."""
    wide = torch.zeros(x.shape[0], x.shape[1] + 12, dtype=x.dtype)
    wide[:, 4:4 + x.shape[1]] = x
    return wide[:, 4:4 + x.shape[1]]


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 16, 17, 33, 49, 100])
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
    y = kernel(x, Bf16Linear.pack(weight, b))
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
    y = kernel(x, Bf16Linear.pack(weight, b))
    torch.testing.assert_close(y.float(), expected.float(), atol=1e-2, rtol=1e-2)
    assert (y != expected).float().mean() < 0.01  # a differing sum order flips a rounding now and then


def test_nan_and_inf_propagate(kernel):
    weight = torch.ones(20, 16, dtype=torch.bfloat16)
    x = torch.ones(3, 16, dtype=torch.bfloat16)
    x[1, 5] = float("nan")
    x[2, 0] = float("inf")
    y = kernel(x, Bf16Linear.pack(weight, None))
    assert torch.equal(y[0], torch.full((20,), 16.0, dtype=torch.bfloat16))
    assert y[1].isnan().all() and y[2].isposinf().all()


def test_refuses_what_it_cannot_do(kernel):
    assert not Bf16Linear.supports(torch.zeros(8, 60, dtype=torch.bfloat16))  # K % 8 != 0
    assert not Bf16Linear.supports(torch.zeros(8, 64))  # not bf16
    packed = Bf16Linear.pack(torch.zeros(8, 64, dtype=torch.bfloat16), None)
    with pytest.raises(TypeError, match="bf16"):
        kernel(torch.zeros(2, 64), packed)
    with pytest.raises(ValueError, match="x has 72 features, the weight 64"):
        kernel(torch.zeros(2, 72, dtype=torch.bfloat16), packed)
    assert kernel(torch.zeros(0, 64, dtype=torch.bfloat16), packed).shape == (0, 8)


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


def test_benchmark_script_runs():
    """benchmarks/linear_kernels.py at a toy size (its figures mean nothing here): the table comes out."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "linear_kernels.py"
    out = subprocess.run([sys.executable, str(script), "--rows", "1", "7", "--shapes", "40x64", "--iters", "1",
                          "--repeats", "1", "--weight-mib", "0"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| 40x64 |")]
    assert len(rows) == 2 and "x |" in rows[1]
