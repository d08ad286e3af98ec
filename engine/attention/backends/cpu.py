"""The CPU backend: decode rows through a compiled kernel that reads paged K/V in place.

The torch reference copies every decode request's KV blocks out of paged memory in each layer
before attending (as many bytes copied as attention reads); this backend hands the decode rows
(one query token each, first in the batch) to kernels/cpu_attention.py, a C kernel built at
first use and cached under the pdserve cache dir, which walks the block tables instead.
Prefill chunks stay on the torch reference (SDPA: compute-bound, the copy is small beside it),
except that a chunk with no cached history attends over the step's own key/value rows rather
than copying them back out of paged memory. The torch reference stays selectable
(`--attention-backend torch`) and is the oracle the tests compare this backend against.
"""
from __future__ import annotations

import torch

from engine.attention.backends.base import AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.builtin_model import cache_dir
from kernels import torch_ref
from kernels.cpu_attention import CpuDecodeAttention


class CpuAttentionBackend(AttentionBackend):
    name = "cpu"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.kernel = CpuDecodeAttention(cache_dir() / "kernels")  # BuildError when no compiler works

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
            torch_ref.attend_request(query, kv_cache, meta.block_tables[b], starts[b], starts[b + 1] - starts[b],
                                     lens[b], scale, out, new_kv)
        return out
