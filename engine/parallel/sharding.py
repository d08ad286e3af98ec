"""A rank's model: the full config narrowed to its shard, and its slice of every checkpoint tensor.

One rule for every model family (Llama, Mistral, Qwen2, Qwen3, Gemma 3): they share Hugging Face's weight
names, so the model classes build a rank's shapes from the narrowed config and load the sliced tensors
through their ordinary `load_weights`. Column-parallel (output rows split): q/k/v, gate/up, the embedding
and the LM head (vocabulary rows, zero-padded to tp x rows). Row-parallel (input columns split, summed by
an all-reduce after): o_proj and down_proj; their bias is added by tp rank 0 only, so the sum holds it once.
Weights of layers on other pipeline stages are never kept.
"""
from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pdserve.engine.parallel.layout import ParallelLayout

_LAYER = re.compile(r"(?:model\.)?layers\.(\d+)\.")


def shard_config(cfg: Any, layout: ParallelLayout) -> Any:
    """A copy of the Hugging Face config with this rank's head, unit and vocabulary counts."""
    if layout.tp == 1:
        return cfg
    d = layout.dims
    local = copy.deepcopy(cfg)
    k0, k1 = layout.kv_heads
    local.num_attention_heads = d.num_heads // layout.tp
    local.num_key_value_heads = k1 - k0
    local.head_dim = d.head_dim  # hidden_size // narrowed heads would be wrong
    local.intermediate_size = d.intermediate_size // layout.tp
    local.vocab_size = layout.vocab_per_rank
    return local


def _rows(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    return t[lo:hi].clone()


def _vocab_rows(t: torch.Tensor, layout: ParallelLayout) -> torch.Tensor:
    v0, v1 = layout.vocab
    out = t.new_zeros((v1 - v0, *t.shape[1:]))
    real = t[v0:min(v1, t.shape[0])]
    out[:real.shape[0]] = real
    return out


def shard_tensor(name: str, t: torch.Tensor, layout: ParallelLayout) -> torch.Tensor | None:
    """This rank's part of checkpoint tensor `name`; None when the rank holds none of it."""
    parts = name.removeprefix("model.").split(".")
    if parts[0] in ("embed_tokens", "lm_head"):
        return _vocab_rows(t, layout) if layout.is_first_stage else None
    if parts[0] == "norm":
        return t if layout.is_last_stage else None
    match = _LAYER.match(name)
    if match is None:
        return t
    lo, hi = layout.layers
    if not lo <= int(match.group(1)) < hi:
        return None
    if layout.tp == 1:
        return t
    hd = layout.dims.head_dim
    proj, kind = parts[3] if len(parts) > 3 else "", parts[-1]
    h0, h1 = layout.heads
    k0, k1 = layout.kv_heads
    i0, i1 = layout.intermediate
    if proj == "q_proj":
        return _rows(t, h0 * hd, h1 * hd)
    if proj in ("k_proj", "v_proj"):
        return _rows(t, k0 * hd, k1 * hd)
    if proj in ("gate_proj", "up_proj"):
        return _rows(t, i0, i1)
    if proj in ("o_proj", "down_proj"):
        if kind == "bias":
            return t if layout.tp_rank == 0 else torch.zeros_like(t)
        c0, c1 = (h0 * hd, h1 * hd) if proj == "o_proj" else (i0, i1)
        return t[:, c0:c1].contiguous()
    return t  # norms (q_norm / k_norm act per head: whole)


def shard_weights(weights: Iterable[tuple[str, torch.Tensor]], layout: ParallelLayout
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        part = shard_tensor(name, tensor, layout)
        if part is not None:
            yield name, part
