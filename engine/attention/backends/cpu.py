"""The CPU backend: decode rows through a compiled kernel that reads paged K/V in place.

The torch reference copies every decode request's KV blocks out of paged memory in each layer
before attending (as many bytes copied as attention reads); this backend hands the decode rows
(one query token each, first in the batch) to kernels/cpu_attention.py, a C kernel built at
first use (or prebuilt at install: common/native_build.py), which walks the block tables instead.
Prefill chunks in bf16 go through kernels/cpu_prefill_attention.py where the CPU has AVX512_BF16
(torch's SDPA runs at a fifth of the dot instruction's speed there): a chunk with no cached history
over the step's own key/value rows (not copied back out of paged memory), a chunk over cached
history over the paged cache in place. Otherwise they take the torch reference (SDPA), which also
reads a fresh prompt's own rows. The torch reference stays selectable
(`--attention-backend torch`) and is the oracle the tests compare this backend against.
"""
from __future__ import annotations

import torch

from pdserve.engine.attention.backends.base import AttentionBackend
from pdserve.engine.attention.metadata import AttentionMetadata
from pdserve.kernels import torch_ref
from pdserve.kernels.cpu_attention import CpuDecodeAttention
from pdserve.kernels.cpu_prefill_attention import CpuPrefillAttention


class CpuAttentionBackend(AttentionBackend):
    name = "cpu"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        # BuildError where a library cannot be had (common/native_build.py): the selector falls back.
        self.kernel = CpuDecodeAttention()
        self.prefill_kernel = CpuPrefillAttention()

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if not self.kernel.write_cache(key, value, kv_cache, meta.slot_mapping):
            torch_ref.reshape_and_cache(key, value, kv_cache, meta.slot_mapping)
        if not self.kernel.supports(query, kv_cache):
            return torch_ref.paged_attention(query, kv_cache, meta.block_tables, meta.query_start_loc_cpu,
                                             meta.seq_lens_cpu, scale)
        out = torch.empty(query.shape, dtype=query.dtype)
        nd = meta.num_decodes
        if nd:
            self.kernel(query, kv_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale, out)
        starts, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        new_kv = (key, value) if key.dtype == kv_cache.dtype else None
        for b in range(nd, meta.num_reqs):
            start, q_len = starts[b], starts[b + 1] - starts[b]
            rows = slice(start, start + q_len)
            if new_kv is not None and q_len == lens[b]:
                q, k, v = query[rows], key[rows], value[rows]
                if self.prefill_kernel.supports(q, k, v):
                    self.prefill_kernel(q, k, v, scale, out[rows])
                    continue
            elif self.prefill_kernel.supports_paged(query, kv_cache):
                self.prefill_kernel.paged(query[rows], kv_cache, meta.block_tables[b], lens[b], scale, out[rows])
                continue
            torch_ref.attend_request(query, kv_cache, meta.block_tables[b], start, q_len, lens[b], scale, out, new_kv)
        return out
