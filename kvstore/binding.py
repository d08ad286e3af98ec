"""What a data-path store is bound to: one model's fingerprint, layer count, dtype and KV shape.

A store opened without them serves administration only (the `pd-kvstore` CLI); the data path checks
its calls against them here, and names the object of a layer's KV head group (kvstore/layout.py).
The store and the members that read for it hold one ModelBinding, so they agree on the model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.kvstore.layout import Heads, object_layer


@dataclass
class ModelBinding:
    fingerprint: str | None
    num_layers: int | None
    dtype: torch.dtype | None
    kv_shape: tuple[int, ...] | None  # (num_kv_heads, head_dim) of the whole model's KV, all ranks' heads

    def check(self, layer: int | None = None) -> None:
        """ValueError unless this binding names a model (and `layer` is one of its layers)."""
        if self.fingerprint is None:
            raise ValueError("this store was opened without a model fingerprint (admin use only)")
        if layer is not None and (layer < 0 or (self.num_layers is not None and layer >= self.num_layers)):
            raise ValueError(f"layer {layer} out of range for a {self.num_layers}-layer store")

    def part(self, layer: int, heads: Heads | None) -> tuple[int | str, tuple[int, ...] | None]:
        """(object layer name, its [H, D]) of layer `layer`'s object holding KV heads `heads` (None: all)."""
        if heads is None:
            return layer, self.kv_shape
        if self.kv_shape is None or not 0 <= heads[0] < heads[1] <= self.kv_shape[0]:
            raise ValueError(f"KV heads {heads} of a store holding {self.kv_shape}")
        return object_layer(layer, heads, self.kv_shape[0]), (heads[1] - heads[0], self.kv_shape[1])
