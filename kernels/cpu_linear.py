"""Linear layers with bf16 weights on CPUs without bf16 instructions.

Wraps kernels/csrc/cpu_linear_bf16.c (see its header for why and for the weight layout):
engine/models/linear.py repacks each bf16 weight once at load (`pack`) and calls the kernel for
the batches it wins when oneDNN cannot pack bf16 weights on this CPU. One ctypes call per linear
layer: the kernel widens x, multiplies, adds the bias and rounds y to bf16 itself.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.cpu_build import load_library

SOURCE = Path(__file__).with_name("csrc") / "cpu_linear_bf16.c"
PANEL = 16  # PANEL in the C source: output columns per weight panel
# Stored position -> column within one k of a panel: position 2j holds column j, 2j+1 column j+8.
_PANEL_ORDER = [c for j in range(PANEL // 2) for c in (j, j + PANEL // 2)]

_c_ptr, _c_int, _c_i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64


@functools.lru_cache(maxsize=None)
def _function(build_dir: Path):
    fn = load_library(SOURCE, build_dir).pd_linear_bf16
    fn.restype = _c_int
    fn.argtypes = [_c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_int, _c_int, _c_int, _c_i64, _c_i64, _c_int]
    return fn


@dataclass
class PackedBf16:
    """A bf16 weight [N, K] as the kernel reads it: panels [ceil(N/16), K, 16] and the bias in fp32,
    zero-padded to whole panels (None without bias)."""
    panels: torch.Tensor
    bias: torch.Tensor | None
    out_features: int
    in_features: int


class Bf16Linear:
    """y = x @ weight^T (+ bias) for bf16 CPU tensors, weights packed by `pack`; build once per process."""

    def __init__(self, build_dir: Path) -> None:
        self._fn = _function(build_dir)

    @staticmethod
    def supports(weight: torch.Tensor) -> bool:
        return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
                and weight.shape[1] % 8 == 0 and weight.shape[1] > 0 and weight.shape[0] > 0)

    @staticmethod
    def pack(weight: torch.Tensor, bias: torch.Tensor | None) -> PackedBf16:
        """The kernel's layout of `weight` (check `supports` first): same bytes as the weight plus the
        padding of the last panel."""
        n, k = weight.shape
        panels = -(-n // PANEL)
        padded = torch.zeros(panels * PANEL, k, dtype=torch.bfloat16)
        padded[:n] = weight.detach()
        order = torch.tensor(_PANEL_ORDER)
        packed = padded.view(panels, PANEL, k)[:, order, :].transpose(1, 2).contiguous()
        b = None
        if bias is not None:
            b = torch.zeros(panels * PANEL, dtype=torch.float32)
            b[:n] = bias.detach().float()
        return PackedBf16(packed, b, n, k)

    def __call__(self, x: torch.Tensor, weight: PackedBf16) -> torch.Tensor:
        """x [M, K] bf16 (any M; rows may be strided) -> [M, N] bf16."""
        if x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.dim() != 2:
            raise TypeError(f"bf16 linear kernel takes 2-d bf16 CPU activations, not {x.dtype} {tuple(x.shape)} "
                            f"on {x.device}")
        if x.stride(-1) != 1:
            x = x.contiguous()
        m, k = x.shape
        if k != weight.in_features:
            raise ValueError(f"x has {k} features, the weight {weight.in_features}")
        n = weight.out_features
        y = torch.empty(m, n, dtype=torch.bfloat16)
        if m == 0:
            return y
        bias = None if weight.bias is None else weight.bias.data_ptr()
        rc = self._fn(y.data_ptr(), x.data_ptr(), weight.panels.data_ptr(), bias, m, n, k, x.stride(0), y.stride(0),
                      torch.get_num_threads())
        if rc != 0:
            raise MemoryError(f"bf16 linear kernel could not allocate scratch for {m} x {k} activations")
        return y
