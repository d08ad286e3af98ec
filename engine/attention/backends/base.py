"""The attention backend interface: one object per engine, chosen once at start-up.

A backend owns the two things a paged-attention layer does with the step's new tokens:
write their K/V into the paged cache (`reshape_and_cache`), then attend over the paged
history. Everything it needs about the batch is in `AttentionMetadata`, built once per step
on the host, so a backend picks kernels and grid sizes from host values, never from a
device->host read inside a layer. New backends (a faster CPU one, say) subclass this and
register in engine/attention/selector.py.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from pdserve.engine.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    name: ClassVar[str]

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @abstractmethod
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Write key/value [num_tokens, kv_heads, head_dim] into `kv_cache` at `meta.slot_mapping`,
        then return the causal attention of query [num_tokens, heads, head_dim] over each request's
        paged history, [num_tokens, heads, head_dim] (query row j of request b sits at position
        seq_len - q_len + j and sees keys [0, that position]).

        `kv_cache` is one layer's [2, num_blocks, block_size, kv_heads, head_dim] tensor; query,
        key and value may be strided views of one fused projection.
        """

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device})"
