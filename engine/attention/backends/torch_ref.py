"""The torch reference backend: the CPU default and every other backend's oracle."""
from __future__ import annotations

import torch

from pdserve.engine.attention.backends.base import AttentionBackend
from pdserve.engine.attention.metadata import AttentionMetadata
from pdserve.kernels import torch_ref


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        torch_ref.reshape_and_cache(key, value, kv_cache, meta.slot_mapping)
        return torch_ref.paged_attention(query, kv_cache, meta.block_tables, meta.query_start_loc_cpu,
                                         meta.seq_lens_cpu, scale)
