"""Paged attention layer and the per-step forward context it reads.

The model runner builds one `ForwardContext` per step (batch layout, KV tensors, the
engine's attention backend, connector) and sets it around the forward pass, so model code
stays free of batch plumbing. Each attention layer waits for its layer of external KV,
lets the backend write the new K/V into paged memory and attend, then hands the layer to
the connector to save (when a connector is present).
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pdserve.engine.attention.backends.base import AttentionBackend
from pdserve.engine.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from pdserve.engine.kv_connector import KVConnectorBase


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata
    kv_caches: list[torch.Tensor]
    attn_backend: AttentionBackend
    connector: KVConnectorBase | None = None
    connector_metadata: Any = None


# Per thread: two engines in one process (a prefill and a decode node in tests) step concurrently.
_local = threading.local()


def get_forward_context() -> ForwardContext:
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        raise RuntimeError("attention called outside set_forward_context (the model runner sets it per step)")
    return ctx


@contextlib.contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[None]:
    previous, _local.ctx = getattr(_local, "ctx", None), ctx
    try:
        yield
    finally:
        _local.ctx = previous


class PagedAttention(nn.Module):
    """Attention of layer `layer_idx` over paged KV, with the connector's per-layer hooks."""

    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [n, heads, dim], k/v [n, kv_heads, dim] of the new tokens -> [n, heads * dim]."""
        ctx = get_forward_context()
        meta = ctx.attn_metadata
        kv_cache = ctx.kv_caches[self.layer_idx]
        if ctx.connector is not None:
            # External KV of this layer must be in paged memory before anything reads it.
            ctx.connector.wait_for_layer_load(self.layer_idx)
        out = ctx.attn_backend.forward(q, k, v, kv_cache, meta, self.scale)
        if ctx.connector is not None:  # after the backend wrote this step's K/V of the layer
            ctx.connector.save_kv_layer(self.layer_idx, kv_cache, ctx.connector_metadata)
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)
