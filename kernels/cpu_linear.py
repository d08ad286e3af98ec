"""Linear layers with bf16 weights for a few activation rows, on CPUs without bf16 instructions.

Wraps kernels/csrc/cpu_linear_bf16.c (see its header for why): engine/models/linear.py calls it
for decode-sized batches when oneDNN cannot pack bf16 weights on this CPU. One ctypes call per
linear layer: the kernel widens x, multiplies, adds the bias and rounds y to bf16 itself.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from kernels.cpu_build import load_library

SOURCE = Path(__file__).with_name("csrc") / "cpu_linear_bf16.c"
MAX_ROWS = 64  # MAX_ROWS in the C source

_c_ptr, _c_int, _c_i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64


@functools.lru_cache(maxsize=None)
def _function(build_dir: Path):
    fn = load_library(SOURCE, build_dir).pd_linear_bf16
    fn.restype = _c_int
    fn.argtypes = [_c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_int, _c_int, _c_int, _c_i64, _c_i64, _c_int]
    return fn


class Bf16Linear:
    """y = x @ weight^T (+ bias) for bf16 CPU tensors of at most MAX_ROWS rows; build once per process."""

    def __init__(self, build_dir: Path) -> None:
        self._fn = _function(build_dir)

    @staticmethod
    def supports(weight: torch.Tensor) -> bool:
        return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
                and weight.is_contiguous() and weight.shape[1] % 8 == 0)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] bf16 with M <= MAX_ROWS (check `supports(weight)` first) -> [M, N] bf16."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        m, k = x.shape
        n = weight.shape[0]
        y = torch.empty(m, n, dtype=torch.bfloat16)
        rc = self._fn(y.data_ptr(), x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                      m, n, k, x.stride(0), y.stride(0), torch.get_num_threads())
        if rc != 0:
            raise MemoryError(f"bf16 linear kernel refused {m} rows (max {MAX_ROWS}) or ran out of memory")
        return y
