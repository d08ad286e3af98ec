"""The ways a CPU linear layer with bf16 weights can run, each with its own weight layout.

All compute y = x @ W^T (+ bias) from bf16 x and W with fp32 sums of the exact bf16 products, rounded
to bf16 (what a bf16 GEMM does); they differ in summation order only. Which one is fastest depends on
the CPU's instructions, not its name (AVX-512 without AVX512_BF16: oneDNN's bf16 GEMM is emulated and
runs below its fp32 GEMM; AVX512_BF16: the dot kernel; AVX2: no bf16 GEMM in oneDNN at all), so
kernels/linear_choice.py measures them at start-up and engine/models/linear.py packs each layer for
the chosen ones.

- `onednn_bf16`: oneDNN's packed bf16 GEMM (torch's mkldnn ops); refuses to pack below AVX-512.
- `onednn_fp32`: an fp32 copy of the weights packed for oneDNN's fp32 GEMM (twice the bytes);
  x is widened per call and y rounded to bf16.
- `bf16_widen`: the compiled kernel that widens the bf16 weights to fp32 in registers (AVX-512F or AVX2 FMAs)
  (kernels/cpu_linear.py `Bf16Linear`); any x86-64.
- `bf16_dot`: the compiled AVX512_BF16 dot kernel (`Bf16DotLinear`), where the CPU (and the
  PDSERVE_CPU_ISA cap) has the instruction.
The compiled two are kept out under PDSERVE_KERNELS=torch (build_or_none).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch

from pdserve.common import cpu_isa
from pdserve.common.native_build import build_or_none


@dataclass(frozen=True)
class LinearPath:
    """One way to run a bf16 linear layer: `pack(weight, bias)` once, then `run(state, x2d)` per call."""

    name: str
    bytes_per_weight: int  # what one weight element costs in this layout
    supports: Callable[[torch.Tensor], bool]
    pack: Callable[[torch.Tensor, torch.Tensor | None], Any]
    run: Callable[[Any, torch.Tensor], torch.Tensor]


def _onednn_pack(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> tuple:
    w = weight.detach().to(dtype)
    b = None if bias is None else bias.detach().to(dtype)
    return torch.ops.mkldnn._reorder_linear_weight(w, 16), b


def _onednn_bf16_run(state: tuple, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), state[0], state[1], "none", [], "")


def _onednn_fp32_run(state: tuple, x: torch.Tensor) -> torch.Tensor:
    y = torch.ops.mkldnn._linear_pointwise(x.float().contiguous(), state[0], state[1], "none", [], "")
    return y.to(x.dtype)


@functools.lru_cache(maxsize=1)
def _onednn_packs_bf16() -> bool:
    """Whether oneDNN packs bf16 weights here (it needs AVX-512 BW/VL/DQ or AVX_NE_CONVERT, under
    ONEDNN_MAX_CPU_ISA)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 16)
        return True
    except RuntimeError:
        return False


def _widen_kernel():
    from pdserve.kernels.cpu_linear import Bf16Linear

    return build_or_none("bf16 linear kernel", Bf16Linear, "bf16 layers use oneDNN")


def _dot_kernel():
    """The dot kernel where the CPU, under the cap, has AVX512_BF16 and the build can run it; else None."""
    if not cpu_isa.has("avx512_bf16"):
        return None
    from pdserve.kernels.cpu_linear import Bf16DotLinear

    kernel = build_or_none("bf16 dot kernel", Bf16DotLinear, "bf16 layers use oneDNN")
    return kernel if kernel is not None and kernel.available else None


def _kernel_path(name: str, kernel_of: Callable[[], Any], cls_name: str) -> LinearPath:
    def cls():
        from pdserve.kernels import cpu_linear

        return getattr(cpu_linear, cls_name)

    def pack(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
        """(the kernel, the weights in its layout): a call then looks nothing up."""
        return kernel_of(), cls().pack(weight.detach(), None if bias is None else bias.detach())

    def run(state: tuple, x: torch.Tensor) -> torch.Tensor:
        return state[0](x, state[1])

    return LinearPath(name, 2, lambda w: cls().supports(w), pack, run)


def _bf16_2d(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2


PATHS: dict[str, LinearPath] = {
    "onednn_bf16": LinearPath("onednn_bf16", 2, _bf16_2d, lambda w, b: _onednn_pack(w, b, torch.bfloat16),
                              _onednn_bf16_run),
    "onednn_fp32": LinearPath("onednn_fp32", 4, _bf16_2d, lambda w, b: _onednn_pack(w, b, torch.float32),
                              _onednn_fp32_run),
    "bf16_widen": _kernel_path("bf16_widen", _widen_kernel, "Bf16Linear"),
    "bf16_dot": _kernel_path("bf16_dot", _dot_kernel, "Bf16DotLinear"),
}
TORCH_PATHS = ("onednn_bf16", "onednn_fp32")  # what PDSERVE_KERNELS=torch leaves


def available() -> tuple[str, ...]:
    """The paths that run in this process (CPU, cap, compiler, PDSERVE_KERNELS), in PATHS' order."""
    ok = {"onednn_bf16": _onednn_packs_bf16(), "onednn_fp32": torch.backends.mkldnn.is_available(),
          "bf16_widen": _widen_kernel() is not None, "bf16_dot": _dot_kernel() is not None}
    return tuple(name for name in PATHS if ok[name])
