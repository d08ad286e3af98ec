"""Causal bf16 prefill attention with the AVX512_BF16 dot instruction, or its arithmetic by AVX-512 FMAs
on CPUs without it (kernels/csrc/cpu_prefill_attention.c).

Two entries: `__call__` for a prompt with no cached history, over its own new keys and values read
from the step's fused projection (strided rows, no copies); `paged` for a chunk over cached history,
reading every key and value from the paged cache through the request's block table (where the
backend has already written the chunk's own). The CPU attention backend
(engine/attention/backends/cpu.py) calls it where `supports`/`supports_paged` say yes and keeps the
torch reference (scaled_dot_product_attention) otherwise: fp32/fp16 models, head dims not a multiple
of 64, CPUs or builds without AVX-512 (`available`).
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from pdserve.common.native_build import load_library

SOURCE = Path(__file__).with_name("csrc") / "cpu_prefill_attention.c"

_p, _i, _i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64


class CpuPrefillAttention:
    """Construct once per process (builds or loads the library); `available`: this build can run it."""

    def __init__(self, build_dir: Path | None = None, extra_flags: tuple[str, ...] = ()) -> None:
        lib = load_library(SOURCE, build_dir, extra_flags)
        self.available = bool(lib.pd_prefill_attention_available())
        self._fn = lib.pd_prefill_attention
        self._fn.restype = _i
        self._fn.argtypes = [_p, _p, _p, _p, _i, _i, _i, _i, _i, _i64, _i64, _i64, _i64, _p, _i, ctypes.c_float, _i]

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

    def supports_paged(self, query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """bf16 CPU query rows (heads dense) over a contiguous bf16 cache [2, blocks, block_size, kv_heads,
        head_dim], head_dim % 64 == 0, GQA groups."""
        if not self.available:
            return False
        heads, head_dim = query.shape[1], query.shape[2]
        return (query.device.type == "cpu" and kv_cache.device.type == "cpu" and query.dtype == torch.bfloat16
                and kv_cache.dtype == torch.bfloat16 and kv_cache.is_contiguous() and query.stride(2) == 1
                and query.stride(1) == head_dim and head_dim % 64 == 0 and kv_cache.shape[4] == head_dim
                and heads % kv_cache.shape[3] == 0)

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                 out: torch.Tensor) -> None:
        """out[i] = causal attention of query row i over key/value rows [0, i] (check `supports` first;
        `out` rows dense in their heads like the query's)."""
        self._run(out, query, key, value, 0, key.shape[1], key.stride(0), value.stride(0), None, 0, scale)

    def paged(self, query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
              scale: float, out: torch.Tensor) -> None:
        """out[i] = causal attention of query row i, the token at position seq_len - len(query) + i, over the
        request's keys/values [0, that position] in the paged cache (check `supports_paged` first)."""
        _, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
        if -(-seq_len // block_size) > block_table.numel() or block_table.dtype != torch.int32 \
                or not block_table.is_contiguous():
            raise ValueError(f"block table of {block_table.numel()} {block_table.dtype} entries cannot hold "
                             f"{seq_len} tokens of {block_size}-token blocks")
        table = block_table[:-(-seq_len // block_size)]
        if int(table.min()) < 0 or int(table.max()) >= num_blocks:
            raise IndexError(f"block table names a block outside the cache's {num_blocks}")
        slot = kv_heads * head_dim
        self._run(out, query, kv_cache[0], kv_cache[1], seq_len - query.shape[0], kv_heads, slot, slot, table,
                  block_size, scale)

    def _run(self, out, query, key, value, ctx, kv_heads, k_stride, v_stride, table, block_size, scale) -> None:
        n, heads, head_dim = query.shape
        rc = self._fn(out.data_ptr(), query.data_ptr(), key.data_ptr(), value.data_ptr(), n, ctx, heads, kv_heads,
                      head_dim, query.stride(0), k_stride, v_stride, out.stride(0),
                      None if table is None else table.data_ptr(), block_size, scale, torch.get_num_threads())
        if rc == -2:
            raise RuntimeError("this build of the prefill attention kernel has neither AVX512_BF16 nor AVX-512 "
                               "(check `available`)")
        if rc != 0:
            raise MemoryError(f"prefill attention could not allocate scratch for {n} rows")
