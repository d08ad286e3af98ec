"""Gemma 3 text decoder (`Gemma3ForCausalLM`: gemma-3-270m, gemma-3-1b) over paged KV.

What differs from Llama (engine/models/llama.py, whose attention, RoPE table, linear layers and weight
loading this reuses):
- RMSNorm scales by (1 + weight), computed in fp32 and rounded once (transformers' Gemma3RMSNorm);
- four norms a layer: the attention and the MLP outputs are normed before their residual add;
- q and k are normed per head before RoPE, and scores scale by query_pre_attn_scalar ** -0.5;
- the embedding is multiplied by sqrt(hidden_size) (rounded to the weights' dtype);
- the MLP is GELU (tanh approximation) gated;
- sliding-window layers rotate with their own RoPE base (`rope_parameters["sliding_attention"]`); the
  window itself is not applied by the attention backends: engine/model_runner.py caps max_model_len at
  `sliding_window`, inside which sliding attention is full attention, so outputs stay exact;
- an optional final logit soft-cap. Attention logit soft-capping (Gemma 2) is refused at start-up.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.models.linear import Linear
from pdserve.engine.models.llama import (Attention, LlamaForCausalLM, RotaryEmbedding, parse_rope, rope_settings,
                                         stage_layers)
from pdserve.engine.parallel.group import SINGLE, ModelShard, TPOps


class GemmaRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """Each head of x [n, heads, head_dim] normed on its own (q_norm / k_norm)."""
        return self(x)


class GemmaMLP(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, tp: TPOps = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"Gemma 3 MLP activation {act!r} is not supported; supported: gelu_pytorch_tanh")
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.intermediate, False, dtype)
        self.down_proj = Linear(self.intermediate, cfg.hidden_size, False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.tp.reduce(self.down_proj(F.gelu(gate, approximate="tanh") * up))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, layer_idx: int, dtype: torch.dtype, tp: TPOps = SINGLE) -> None:
        super().__init__()
        eps, hidden = cfg.rms_norm_eps, cfg.hidden_size
        bias = bool(getattr(cfg, "attention_bias", False))
        self.input_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.self_attn = Attention(cfg, layer_idx, bias, bias, dtype, GemmaRMSNorm,
                                   scale=cfg.query_pre_attn_scalar ** -0.5, tp=tp)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.mlp = GemmaMLP(cfg, dtype, tp)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The residual stream after this layer; with `keep_rows`, only those rows past attention (as in
        llama.py's DecoderLayer: every row's K/V is still written)."""
        h = self.self_attn(self.input_layernorm(x), rope)
        if keep_rows is not None:
            h, x = h[keep_rows], x[keep_rows]
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


def _layer_rope_settings(cfg: Any, layer_type: str) -> tuple[float, dict[str, Any]]:
    """(theta, scaling parameters) of one layer type: transformers 5 nests rope_parameters by layer type."""
    params = getattr(cfg, "rope_parameters", None) or {}
    if layer_type in params:
        return parse_rope(params[layer_type], 10000.0)
    return rope_settings(cfg)


class Gemma3ForCausalLM(LlamaForCausalLM):
    carries_residual = False  # its layers add their own residual: a stage hands on one stream

    def __init__(self, cfg: Any, dtype: torch.dtype, max_positions: int | None = None,
                 shard: ModelShard | None = None) -> None:
        nn.Module.__init__(self)
        self.shard = shard = shard or ModelShard.whole(cfg.num_hidden_layers)
        self.arch = "Gemma3ForCausalLM"
        if getattr(cfg, "attn_logit_softcapping", None) is not None:
            raise ValueError("attention logit soft-capping (attn_logit_softcapping) is not supported")
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ValueError("bidirectional attention (use_bidirectional_attention) is not supported")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.layer_types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers)
        positions = max_positions or cfg.max_position_embeddings
        self.rotary = nn.ModuleDict({t: RotaryEmbedding(head_dim, positions, *_layer_rope_settings(cfg, t), dtype)
                                     for t in sorted(set(self.layer_types))})
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", True))
        self.register_buffer("normalizer", torch.tensor(cfg.hidden_size ** 0.5, dtype=dtype), persistent=False)
        self.layers = stage_layers(cfg, shard, lambda i: GemmaDecoderLayer(cfg, i, dtype, shard.tp))
        self._ends(cfg, dtype, GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype) if shard.last else None)
        self.final_logit_softcapping = getattr(cfg, "final_logit_softcapping", None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, keep_rows: torch.Tensor | None = None,
                carry: tuple[torch.Tensor, None] | None = None) -> Any:
        x = self.shard.tp.embed(input_ids, self.embed_tokens) * self.normalizer if carry is None else carry[0]
        ropes = {t: rotary(positions) for t, rotary in self.rotary.items()}
        last = len(self.layers) - 1
        for i in range(*self.shard.layers):
            x = self.layers[i](x, ropes[self.layer_types[i]], keep_rows if i == last else None)
        return self.norm(x) if self.shard.last else (x, None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.shard.tp.gather_logits(self.lm_head(hidden))
        cap = self.final_logit_softcapping
        if cap is not None:  # in the weights' dtype, as transformers does
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
