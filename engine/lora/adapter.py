"""A loaded LoRA adapter, laid out for the engine's fused linear layers.

PEFT names the projections transformers has (q_proj, k_proj, ..., up_proj); the engine fuses q/k/v into
`qkv_proj` and gate/up into `gate_up_proj` (engine/models/llama.py). So an adapter's pairs are grouped per
fused layer: one A stacked over its parts ([sum of ranks, in]) and, per part, the B that writes that
part's output columns. Weights are held in fp32 (values rounded first to `--lora-dtype`: by default the
model's dtype, as vLLM holds them; `float32` keeps PEFT's, its `autocast_adapter_dtype`), and the delta is
added in fp32 and rounded once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

# PEFT's module name -> (block, the engine's linear layer, index of its part in that layer's output)
PEFT_MODULES: dict[str, tuple[str, str, int]] = {
    "q_proj": ("self_attn", "qkv_proj", 0), "k_proj": ("self_attn", "qkv_proj", 1),
    "v_proj": ("self_attn", "qkv_proj", 2), "o_proj": ("self_attn", "o_proj", 0),
    "gate_proj": ("mlp", "gate_up_proj", 0), "up_proj": ("mlp", "gate_up_proj", 1),
    "down_proj": ("mlp", "down_proj", 0),
}


class LoRAError(ValueError):
    """An adapter that cannot be served: its directory, config, weights or rank (a 400 for a server)."""


@dataclass(frozen=True)
class TargetLayout:
    """The base model's shapes an adapter must fit: per linear layer, its input width and its parts' widths."""

    num_layers: int
    layers: tuple[int, ...]  # indices of the layers this engine holds
    parts: dict[str, tuple[int, tuple[int, ...]]]  # linear name -> (in features, output width of each part)

    @classmethod
    def of(cls, model: Any, hidden_size: int) -> TargetLayout:
        held = [i for i, layer in enumerate(model.layers) if hasattr(layer, "self_attn")]
        attn, mlp = model.layers[held[0]].self_attn, model.layers[held[0]].mlp
        q, kv, inter = attn.q_size, attn.kv_size, mlp.intermediate
        return cls(len(model.layers), tuple(held), {
            "qkv_proj": (hidden_size, (q, kv, kv)), "o_proj": (q, (hidden_size,)),
            "gate_up_proj": (hidden_size, (inter, inter)), "down_proj": (inter, (hidden_size,))})

    def shape_of(self, peft_module: str) -> tuple[int, int, int]:
        """(in features, output offset, output rows) of a PEFT module inside its fused layer."""
        _, linear, part = PEFT_MODULES[peft_module]
        in_features, widths = self.parts[linear]
        return in_features, sum(widths[:part]), widths[part]


@dataclass(frozen=True)
class LoRAPart:
    """One PEFT module inside a fused layer: output columns [offset, offset + rows), its rank rows of A."""

    offset: int
    rows: int
    rank_start: int
    rank_end: int
    b: torch.Tensor  # [rows, rank], fp32


@dataclass(frozen=True)
class LoRAModule:
    """An adapter's pairs on one linear layer of one block."""

    a: torch.Tensor  # [sum of the parts' ranks, in], fp32
    parts: tuple[LoRAPart, ...]

    def to(self, device: torch.device) -> LoRAModule:
        return LoRAModule(self.a.to(device), tuple(LoRAPart(p.offset, p.rows, p.rank_start, p.rank_end,
                                                            p.b.to(device)) for p in self.parts))


@dataclass(eq=False)
class LoRAAdapter:
    """Compared by identity: two loads of one directory are two adapters (with equal fingerprints)."""

    name: str
    int_id: int
    path: str
    rank: int
    scaling: float
    fingerprint: str  # common/hashing.adapter_fingerprint of its config and weights
    modules: dict[tuple[int, str], LoRAModule]  # (layer index, linear name) -> its pairs
    target_modules: tuple[str, ...]
    stamp: tuple[Any, ...] = ()  # the files' (size, mtime): a changed directory is read again
    num_bytes: int = field(default=0)

    @property
    def label(self) -> str:
        """How log lines name it: the name and the start of its fingerprint (names can be reused)."""
        return f"{self.name} ({self.fingerprint[:12]})"
