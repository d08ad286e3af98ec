"""What a data-path store is bound to: one model's fingerprint, layer count, dtype and KV shape.

A store opened without them serves administration only (the `pd-kvstore` CLI); the data path checks
its calls against them here, and names the object of a layer's KV head group (kvstore/layout.py).
The store and the members that read for it hold one ModelBinding, so they agree on the model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.kvstore import object_format, payload_codecs
from pdserve.kvstore.errors import CorruptObject
from pdserve.kvstore.layout import Heads, WriterLayout, object_layer


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

    def layout_damage(self, layout: WriterLayout) -> str | None:
        """Why a chunk of this model cannot have the layout its commit marker records (a layer or KV head count
        that is not the model's, where this binding names them: the fingerprint covers both), or None. Checked
        before a lookup trusts a marker (`admit`) and before repair sizes anything by it."""
        if self.num_layers is not None and layout.num_layers != self.num_layers:
            return f"commit marker records {layout.num_layers} layers, the model has {self.num_layers}"
        if self.kv_shape is not None and layout.num_kv_heads not in (0, self.kv_shape[0]):
            return f"commit marker records {layout.num_kv_heads} KV heads, the model has {self.kv_shape[0]}"
        return None

    def admit(self, layout: WriterLayout | None) -> WriterLayout | None:
        """A marker's layout as lookups keep it: None (unreadable: the load fails, repair heals) unless it is one
        this model's chunks can have."""
        return layout if layout is not None and self.layout_damage(layout) is None else None

    def trusted(self, layout: WriterLayout | None, marker: str) -> WriterLayout:
        """The layout the commit marker `marker` records, for a load; CorruptObject when it is unreadable (None)
        or not one of this model's (the connector then repairs the chunk)."""
        reason = "corrupted commit marker" if layout is None else self.layout_damage(layout)
        if reason is not None:
            raise CorruptObject(f"{marker}: {reason}")
        return layout

    def chunk_bytes(self, tokens: int, codec: str) -> int | None:
        """The stored bytes of one chunk of `tokens` tokens (every layer's object, all KV heads) written with
        `codec` (lossless, whose size depends on the values: the raw size); None where the model is not bound."""
        if self.num_layers is None or self.dtype is None or self.kv_shape is None:
            return None
        heads, dim = self.kv_shape
        count = 2 * tokens * heads * dim
        payload = payload_codecs.payload_bytes(codec, count, dim, self.dtype.itemsize)
        return self.num_layers * (object_format.HEADER_SIZE + (count * self.dtype.itemsize if payload is None
                                                               else payload))

    def part(self, layer: int, heads: Heads | None) -> tuple[int | str, tuple[int, ...] | None]:
        """(object layer name, its [H, D]) of layer `layer`'s object holding KV heads `heads` (None: all)."""
        if heads is None:
            return layer, self.kv_shape
        if self.kv_shape is None or not 0 <= heads[0] < heads[1] <= self.kv_shape[0]:
            raise ValueError(f"KV heads {heads} of a store holding {self.kv_shape}")
        return object_layer(layer, heads, self.kv_shape[0]), (heads[1] - heads[0], self.kv_shape[1])
