"""The compiled elementwise steps of a Llama block on CPU (kernels/csrc/cpu_block_ops.c).

Residual add + RMSNorm, RoPE and SiLU-and-multiply, each one ctypes call over all rows instead of
4-9 torch ops. Each method checks what the C code assumes (CPU, fp32 or bf16, dense rows) and
returns None when a tensor does not fit, so the caller (engine/models/block_ops.py) runs the torch
reference instead. Rounding: see the C source's header.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from pdserve.common.native_build import load_library

SOURCE = Path(__file__).with_name("csrc") / "cpu_block_ops.c"
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}

_p, _i, _i64, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float


def _dense_rows(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.stride(1) == 1 and t.stride(0) == t.shape[1]


class CpuBlockOps:
    """Construct once per process (builds or loads the library)."""

    def __init__(self, build_dir: Path | None = None, extra_flags: tuple[str, ...] = ()) -> None:
        lib = load_library(SOURCE, build_dir, extra_flags)
        self._norm = self._entry(lib.pd_add_rms_norm, [_p, _p, _p, _p, _i64, _i64, _f, _i, _i])
        self._rope = self._entry(lib.pd_rope, [_p, _p, _i64, _p, _p, _i64, _i, _i, _i, _i])
        self._silu_mul = self._entry(lib.pd_silu_mul, [_p, _p, _i64, _i64, _i, _i])

    @staticmethod
    def _entry(fn, argtypes):
        fn.restype = _i
        fn.argtypes = argtypes
        return fn

    @staticmethod
    def _code(*tensors: torch.Tensor) -> int | None:
        """The C code's dtype code when every tensor is a CPU tensor of one supported dtype, else None
        (a plain loop: a decode step makes ~50 of these calls)."""
        dtype = tensors[0].dtype
        code = _DTYPE_CODES.get(dtype)
        if code is None:
            return None
        for t in tensors:
            if t.dtype != dtype or not t.is_cpu:
                return None
        return code

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(norm(residual + x), residual + x), or (norm(x), x) without a residual. The sum is written
        into `residual`'s storage (the caller's running residual stream); None if unsupported."""
        tensors = (x, weight) if residual is None else (x, weight, residual)
        code = self._code(*tensors)
        if code is None or not _dense_rows(x) or not weight.is_contiguous() or weight.numel() != x.shape[1] \
                or (residual is not None and (not _dense_rows(residual) or residual.shape != x.shape)):
            return None
        out = torch.empty_like(x)
        stream, delta = (x, None) if residual is None else (residual, x)
        self._norm(out.data_ptr(), stream.data_ptr(), None if delta is None else delta.data_ptr(),
                   weight.data_ptr(), x.shape[0], x.shape[1], eps, code, torch.get_num_threads())
        return out, stream

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
        """x [n, heads, head_dim] (rows may be strided, heads dense) rotated by cos/sin [n, head_dim]
        (sin with rotate_half's sign folded in, as engine/models/llama.py's table holds it)."""
        code = self._code(x, cos, sin)
        n, heads, head_dim = x.shape
        if code is None or head_dim % 2 or x.stride(2) != 1 or x.stride(1) != head_dim \
                or not (_dense_rows(cos) and _dense_rows(sin)) or cos.shape != (n, head_dim) \
                or sin.shape != cos.shape:
            return None
        out = torch.empty((n, heads, head_dim), dtype=x.dtype)
        self._rope(out.data_ptr(), x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), n, heads,
                   head_dim, code, torch.get_num_threads())
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up for gate_up = [gate | up] rows [n, 2 * inter]."""
        code = self._code(gate_up)
        if code is None or not _dense_rows(gate_up) or gate_up.shape[1] % 2:
            return None
        n, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((n, inter), dtype=gate_up.dtype)
        self._silu_mul(out.data_ptr(), gate_up.data_ptr(), n, inter, code, torch.get_num_threads())
        return out
