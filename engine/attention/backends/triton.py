"""The Triton backend: the CUDA default (and, with TRITON_INTERPRET=1, testable on CPU).

Decode rows (one query token each, first in the batch) take the paged decode kernel, split
over the KV length (flash-decoding) when few sequences would leave the GPU idle; the rest
take the context kernel, which attends chunked prefills over their paged history. Both write
into one output tensor, so a mixed batch costs two launches plus the cache write.
"""
from __future__ import annotations

import torch

from pdserve.engine.attention.backends.base import AttentionBackend
from pdserve.engine.attention.metadata import AttentionMetadata


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        # Imported here: TRITON_INTERPRET must be set before the kernel modules load on CPU.
        from pdserve.kernels import triton_attention, triton_transfer

        self._attention = triton_attention
        self._transfer = triton_transfer
        self.num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                        if device.type == "cuda" else 1)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        self._transfer.reshape_and_cache(key, value, kv_cache, meta.slot_mapping)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        nd = meta.num_decodes
        if nd:
            splits = self._attention.num_kv_splits(nd, kv_cache.shape[3], meta.max_decode_seq_len, self.num_sms)
            self._attention.paged_decode_attention(query, kv_cache, meta.block_tables[:nd],
                                                   meta.query_start_loc[:nd + 1], meta.seq_lens[:nd], scale,
                                                   out=out, num_splits=splits,
                                                   max_seq_len=meta.max_decode_seq_len)
        if meta.num_prefills:
            self._attention.context_attention(query, kv_cache, meta.block_tables[nd:], meta.query_start_loc[nd:],
                                              meta.seq_lens[nd:], scale, meta.max_query_len, out=out)
        return out
