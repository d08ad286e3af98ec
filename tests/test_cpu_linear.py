"""The compiled bf16 small-batch linear kernel against an fp32 product, and the build cache behind it.

The kernel runs whatever the CPU (the engine uses it only where oneDNN cannot pack bf16): rows
1..5 cover its 3-, 2- and 1-row tiles, 50 outputs a 4-row weight tile tail, a strided x a view
of a wider tensor, 64 rows its limit.
"""
from __future__ import annotations

import pytest
import torch

from kernels.cpu_build import load_library
from kernels.cpu_linear import MAX_ROWS, Bf16Linear


@pytest.fixture(scope="module")
def kernel(tmp_path_factory) -> Bf16Linear:
    return Bf16Linear(tmp_path_factory.mktemp("kernels"))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, MAX_ROWS])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_fp32_product_rounded_to_bf16(kernel, rows, bias):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(50, 72, generator=g).to(torch.bfloat16)
    b = torch.randn(50, generator=g).to(torch.bfloat16) if bias else None
    x = torch.randn(rows, 80, generator=g).to(torch.bfloat16)[:, 4:76]  # rows strided, not contiguous
    assert Bf16Linear.supports(weight)
    expected = x.float() @ weight.float().T + (b.float() if bias else 0)
    torch.testing.assert_close(kernel(x, weight, b).float(), expected.to(torch.bfloat16).float(), atol=1e-2,
                               rtol=1e-2)


def test_refuses_what_it_cannot_do(kernel):
    assert not Bf16Linear.supports(torch.zeros(8, 60, dtype=torch.bfloat16))  # K % 8 != 0
    assert not Bf16Linear.supports(torch.zeros(8, 64))  # not bf16
    assert not Bf16Linear.supports(torch.zeros(64, 8, dtype=torch.bfloat16).T)  # not contiguous
    with pytest.raises(MemoryError, match="refused 65 rows"):
        kernel(torch.zeros(MAX_ROWS + 1, 64, dtype=torch.bfloat16), torch.zeros(8, 64, dtype=torch.bfloat16), None)


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
