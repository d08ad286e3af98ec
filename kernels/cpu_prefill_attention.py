"""Causal bf16 prompt attention with the AVX512_BF16 dot instruction (kernels/csrc/cpu_prefill_attention.c).

For prefill chunks with no cached history: the prompt attends over its own new keys and values,
read from the step's fused projection (strided rows, no copies). The CPU attention backend
(engine/attention/backends/cpu.py) calls it where `supports` says yes and keeps the torch reference
(scaled_dot_product_attention) otherwise: fp32/fp16 models, head dims not a multiple of 64, CPUs or
builds without AVX512_BF16 (`available`).
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kernels.cpu_build import load_library

SOURCE = Path(__file__).with_name("csrc") / "cpu_prefill_attention.c"
HEADERS = (SOURCE.with_name("vec_exp.h"),)

_p, _i, _i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64


class CpuPrefillAttention:
    """Construct once per process (builds or loads the library); `available`: this build can run it."""

    def __init__(self, build_dir: Path, extra_flags: tuple[str, ...] = ()) -> None:
        lib = load_library(SOURCE, build_dir, extra_flags, HEADERS)
        self.available = bool(lib.pd_prefill_attention_available())
        self._fn = lib.pd_prefill_attention
        self._fn.restype = _i
        self._fn.argtypes = [_p, _p, _p, _p, _i, _i, _i, _i, _i64, _i64, _i64, _i64, ctypes.c_float, _i]

    def supports(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
        """bf16 CPU rows [n, heads, head_dim] with heads dense in a row, head_dim % 64 == 0, GQA groups."""
        if not self.available:
            return False
        heads, head_dim = query.shape[1], query.shape[2]
        kv_heads = key.shape[1]
        return (all(t.device.type == "cpu" and t.dtype == torch.bfloat16 and t.stride(2) == 1
                    and t.stride(1) == head_dim for t in (query, key, value))
                and head_dim % 64 == 0 and key.shape == value.shape and key.shape[2] == head_dim
                and key.shape[0] == query.shape[0] and heads % kv_heads == 0)

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                 out: torch.Tensor) -> None:
        """out[i] = causal attention of query row i over key/value rows [0, i] (check `supports` first;
        `out` rows dense in their heads like the query's)."""
        n, heads, head_dim = query.shape
        rc = self._fn(out.data_ptr(), query.data_ptr(), key.data_ptr(), value.data_ptr(), n, heads, key.shape[1],
                      head_dim, query.stride(0), key.stride(0), value.stride(0), out.stride(0), scale,
                      torch.get_num_threads())
        if rc == -2:
            raise RuntimeError("this build of the prefill attention kernel has no AVX512_BF16 (check `available`)")
        if rc != 0:
            raise MemoryError(f"prefill attention could not allocate scratch for {n} rows")
