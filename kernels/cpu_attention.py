"""Fast CPU paged decode attention: a compiled C kernel that reads K/V where they lie in paged memory.

Decode steps dominate serving time, and in them the torch reference spends about as long
copying each request's KV blocks out of paged memory (an index_select per layer) as attending
over the copy. `kernels/csrc/cpu_decode_attention.c` walks the block tables instead and reads
every key and value once (see its header for the work split). The torch reference
(kernels/torch_ref.py) stays the oracle the tests compare this kernel against.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from pdserve.common.native_build import load_library

SOURCE = Path(__file__).with_name("csrc") / "cpu_decode_attention.c"
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
MAX_GROUP = 16  # query heads per kv head (MAX_GROUP in the C source)
# The vector path a build takes for bf16 caches (pd_decode_attention_isa): fp32/fp16 caches take the
# AVX2 path whenever the build has AVX2; head_dims not a multiple of 8 take plain C below AVX-512.
ISA_PATHS = ("c", "avx2", "avx512", "avx512_bf16")

_c_ptr, _c_int, _c_i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64


class CpuDecodeAttention:
    """The compiled decode kernel; construct once per process (it builds or loads the library)."""

    def __init__(self, build_dir: Path | None = None, extra_flags: tuple[str, ...] = ()) -> None:
        """`extra_flags`: appended to the build's flags; tests use e.g. ("-mno-avx512f",) to build and
        check the lower ISA paths on a machine that would not take them."""
        self.extra_flags = extra_flags
        lib = load_library(SOURCE, build_dir, extra_flags)
        self.isa = ISA_PATHS[lib.pd_decode_attention_isa()]
        self._fn = lib.pd_paged_decode_attention
        self._fn.restype = _c_int
        self._fn.argtypes = [_c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_int, _c_int, _c_int, _c_int, _c_int,
                             _c_i64, _c_i64, _c_i64, _c_i64, ctypes.c_float, _c_int, _c_int]
        self._write = lib.pd_write_kv_cache
        self._write.restype = _c_int
        self._write.argtypes = [_c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_i64, _c_i64, _c_i64, _c_i64, _c_i64, _c_int]

    @staticmethod
    def supports(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """CPU tensors of one supported dtype, heads dense within a query row, a contiguous cache."""
        num_heads, head_dim = query.shape[1], query.shape[2]
        num_kv_heads = kv_cache.shape[3]
        return (query.is_cpu and kv_cache.is_cpu and query.dtype == kv_cache.dtype and query.dtype in _DTYPE_CODES
                and kv_cache.is_contiguous() and query.stride(2) == 1 and query.stride(1) == head_dim
                and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= MAX_GROUP)

    def write_cache(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> bool:
        """kernels/torch_ref.reshape_and_cache in one call; False (nothing written) when the tensors do not
        fit it: CPU, the cache's dtype, heads dense within a row, int64 slots."""
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        row = num_kv_heads * head_dim
        if not (key.is_cpu and key.dtype == value.dtype == kv_cache.dtype and kv_cache.is_contiguous()
                and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous() and slot_mapping.is_cpu):
            return False
        for t in (key, value):
            if t.shape[1:] != (num_kv_heads, head_dim) or t.stride(2) != 1 or t.stride(1) != head_dim:
                return False
        if self._write(kv_cache.data_ptr(), key.data_ptr(), value.data_ptr(), slot_mapping.data_ptr(),
                       slot_mapping.numel(), key.stride(0), value.stride(0), row, num_blocks * block_size,
                       kv_cache.element_size()) != 0:
            raise IndexError("KV cache write: a slot past the cache")
        return True

    def __call__(self, query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, out: torch.Tensor) -> None:
        """out[b] = attention of query[b] (request b's one new token) over its first seq_lens[b] keys,
        for b < len(seq_lens). Call `supports` first; `out` rows must be dense like the query's."""
        num_reqs = seq_lens.numel()
        if num_reqs == 0:
            return
        _, num_heads, head_dim = query.shape
        _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
        if block_tables.dtype != torch.int32 or block_tables.stride(-1) != 1:
            block_tables = block_tables.to(torch.int32).contiguous()
        if seq_lens.dtype != torch.int32 or not seq_lens.is_contiguous():
            seq_lens = seq_lens.to(torch.int32).contiguous()
        rc = self._fn(out.data_ptr(), query.data_ptr(), kv_cache.data_ptr(), block_tables.data_ptr(),
                      seq_lens.data_ptr(), num_reqs, num_heads, num_kv_heads, head_dim, block_size, num_blocks,
                      block_tables.stride(0), query.stride(0), out.stride(0), scale, _DTYPE_CODES[query.dtype],
                      torch.get_num_threads())
        if rc != 0:
            raise MemoryError("CPU decode attention could not allocate its scratch buffers")
