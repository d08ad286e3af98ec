"""Llama-family decoder (Llama, Qwen2, Mistral, Qwen3) over paged KV.

Pre-norm blocks: RMSNorm -> attention (fused qkv projection, [Qwen3: RMSNorm of each q and k head],
RoPE, GQA) -> residual,
RMSNorm -> SwiGLU MLP (fused gate/up projection) -> residual. The elementwise steps (residual add
+ norm, RoPE, SiLU-and-multiply) live in engine/models/block_ops.py, in the order transformers uses,
so fp32 logits agree with it to rounding. Layers pass the residual stream on beside the hidden
states, so that each residual add happens inside the next norm.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pdserve.engine.attention import PagedAttention
from pdserve.engine.models import block_ops
from pdserve.engine.models.linear import Linear
from pdserve.engine.parallel.group import SINGLE, ModelShard, TPOps


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); (norm(x), x) for the first layer's input."""
        return block_ops.add_rms_norm(x, residual, self.weight, self.eps)

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """Each head of x [n, heads, head_dim] normed on its own (Qwen3's q_norm / k_norm)."""
        return block_ops.add_rms_norm(x.reshape(-1, x.shape[-1]), None, self.weight, self.eps)[0].view(x.shape)


def rope_settings(hf_config: Any) -> tuple[float, dict[str, Any]]:
    """(theta, scaling parameters) from either transformers 5 `rope_parameters` or older fields."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy = getattr(hf_config, "rope_scaling", None)
    if isinstance(legacy, dict):
        params = {**legacy, **params}
    return parse_rope(params, getattr(hf_config, "rope_theta", 10000.0))


def parse_rope(params: dict[str, Any], default_theta: float) -> tuple[float, dict[str, Any]]:
    """(theta, scaling parameters) of one `rope_parameters` dict; a rope_type we do not compute is an error."""
    params = dict(params)
    theta = params.get("rope_theta", default_theta)
    rope_type = params.get("rope_type", params.get("type", "default"))
    params["rope_type"] = rope_type
    if rope_type not in ("default", "linear", "llama3"):
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, linear, llama3")
    return float(theta), params


def rope_inv_freq(head_dim: int, theta: float, params: dict[str, Any]) -> torch.Tensor:
    """On the CPU whatever the engine's device, as transformers computes it."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    if params["rope_type"] == "linear":
        return inv_freq / params["factor"]
    if params["rope_type"] == "llama3":
        # Long wavelengths are slowed down by `factor`, short ones kept, the band between interpolated.
        factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        context = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
        blend = (context / wavelen - low) / (high - low)
        smoothed = (1 - blend) * scaled / factor + blend * scaled
        medium = (wavelen >= context / high) & (wavelen <= context / low)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin per position in HF's half-split layout, looked up once per step.

    The table is built on the default device (the engine's, see ModelRunner): transformers takes
    cos/sin of the same fp32 products on the model's device, so the two agree to the bit."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, params: dict[str, Any],
                 dtype: torch.dtype) -> None:
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.float32)
        inv_freq = rope_inv_freq(head_dim, theta, params).to(positions.device)
        freqs = positions[:, None] * inv_freq[None, :]
        self.register_buffer("cos", torch.cat((freqs.cos(), freqs.cos()), -1).to(dtype), persistent=False)
        # The sign of rotate_half folded into the table: x*cos + cat(x2, x1)*sin == HF's x*cos + cat(-x2, x1)*sin.
        self.register_buffer("sin", torch.cat((-freqs.sin(), freqs.sin()), -1).to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [n, head_dim] of each row's position."""
        return self.cos[positions], self.sin[positions]


class Attention(nn.Module):
    """With `qk_norm` (a norm class with a `heads` method: Qwen3's, Gemma 3's), q and k are normed per head
    before RoPE; `scale` defaults to head_dim ** -0.5."""

    def __init__(self, cfg: Any, layer_idx: int, qkv_bias: bool, o_bias: bool, dtype: torch.dtype,
                 qk_norm: type[nn.Module] | None = None, scale: float | None = None, tp: TPOps = SINGLE) -> None:
        super().__init__()
        self.tp = tp  # under tensor parallelism cfg holds this rank's head counts (engine/parallel/sharding.py)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, qkv_bias, dtype)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, o_bias, dtype)
        self.q_norm = self.k_norm = None
        if qk_norm is not None:
            self.q_norm = qk_norm(self.head_dim, cfg.rms_norm_eps, dtype)
            self.k_norm = qk_norm(self.head_dim, cfg.rms_norm_eps, dtype)
        self.attn = PagedAttention(layer_idx, self.num_heads, self.num_kv_heads, self.head_dim,
                                   scale=self.head_dim ** -0.5 if scale is None else scale)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        qk = qkv[:, :self.q_size + self.kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm.heads(qk[:, :self.num_heads]), self.k_norm.heads(qk[:, self.num_heads:])), 1)
        qk = block_ops.rope(qk, *rope)  # q and k heads side by side: one rotation for both
        v = qkv[:, self.q_size + self.kv_size:].view(-1, self.num_kv_heads, self.head_dim)
        out = self.attn(qk[:, :self.num_heads], qk[:, self.num_heads:], v)
        return self.tp.reduce(self.o_proj(out))


class MLP(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, tp: TPOps = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "mlp_bias", False):
            raise ValueError("only SwiGLU MLPs without bias (hidden_act='silu') are supported")
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.intermediate, False, dtype)
        self.down_proj = Linear(self.intermediate, cfg.hidden_size, False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.reduce(self.down_proj(block_ops.silu_mul(self.gate_up_proj(x))))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Any, layer_idx: int, qkv_bias: bool, o_bias: bool, dtype: torch.dtype,
                 qk_norm: bool = False, tp: TPOps = SINGLE) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, layer_idx, qkv_bias, o_bias, dtype, RMSNorm if qk_norm else None, tp=tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype, tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
                keep_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the next norm adds the two.

        With `keep_rows`, every row still goes through attention (its K/V is written to the cache),
        but only those rows go on through o_proj's residual, the norm and the MLP, in that order."""
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, rope)
        if keep_rows is not None:
            h, residual = h[keep_rows], residual[keep_rows]
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class _OtherStage(nn.Identity):
    """A layer another pipeline stage holds: keeps layer indices global, holds no weights."""


def stage_layers(cfg: Any, shard: ModelShard, make: Any) -> nn.ModuleList:
    lo, hi = shard.layers
    return nn.ModuleList(make(i) if lo <= i < hi else _OtherStage() for i in range(cfg.num_hidden_layers))


class LlamaForCausalLM(nn.Module):
    """Also Qwen2 (bias on q/k/v, usually tied embeddings), Mistral (same math as Llama) and Qwen3 (q/k
    RMSNorm per head, head_dim independent of hidden_size / heads, no qkv bias unless attention_bias).

    Under pipeline parallelism (`shard`) the layers of other stages are placeholders, the first stage alone
    embeds and has the LM head, the last alone has the final norm; `forward` then takes and returns the
    stage's (hidden, residual) `carry`."""

    carries_residual = True  # a stage hands on (hidden, residual), not one stream

    def __init__(self, cfg: Any, dtype: torch.dtype, max_positions: int | None = None,
                 shard: ModelShard | None = None) -> None:
        super().__init__()
        self.shard = shard = shard or ModelShard.whole(cfg.num_hidden_layers)
        self.arch = arch = (getattr(cfg, "architectures", None) or ["LlamaForCausalLM"])[0]
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        qkv_bias = arch == "Qwen2ForCausalLM" or attention_bias
        o_bias = arch != "Qwen2ForCausalLM" and attention_bias
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        theta, rope_params = rope_settings(cfg)
        self.rotary = RotaryEmbedding(head_dim, max_positions or cfg.max_position_embeddings, theta, rope_params,
                                      dtype)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        qk_norm = arch == "Qwen3ForCausalLM"
        self.layers = stage_layers(cfg, shard, lambda i: DecoderLayer(cfg, i, qkv_bias, o_bias, dtype, qk_norm,
                                                                      shard.tp))
        self._ends(cfg, dtype, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype) if shard.last else None)

    def _ends(self, cfg: Any, dtype: torch.dtype, norm: nn.Module | None) -> None:
        """The embedding and LM head (first stage), the final norm (last stage)."""
        self.embed_tokens = self.lm_head = None
        if self.shard.first:
            self.embed_tokens = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype),
                                             requires_grad=False)
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, dtype)
            if self.tie_word_embeddings:
                self.lm_head.weight = self.embed_tokens
        self.norm = norm

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, keep_rows: torch.Tensor | None = None,
                carry: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> Any:
        """Hidden states [n, hidden] of a flattened batch (layout in the forward context); with
        `keep_rows`, only those rows' [len(keep_rows), hidden], in that order.

        Rows are independent after the last layer's attention: a prompt's rows whose logits nobody
        reads need their K/V from every layer, but not the last layer's MLP (docs/architecture.md,
        "Last-layer rows")."""
        x, residual = (self.shard.tp.embed(input_ids, self.embed_tokens), None) if carry is None else carry
        rope = self.rotary(positions)
        last = len(self.layers) - 1
        for i in range(*self.shard.layers):
            x, residual = self.layers[i](x, residual, rope, keep_rows if i == last else None)
        return self.norm(x, residual)[0] if self.shard.last else (x, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shard.tp.gather_logits(self.lm_head(hidden)).float()

    # ---- weights ----
    def _target(self, name: str) -> tuple[torch.Tensor, int, int] | None:
        """Where checkpoint tensor `name` goes: (parameter, row offset, rows); None to skip it."""
        parts = name.removeprefix("model.").split(".")
        if parts[0] == "embed_tokens":
            return self.embed_tokens, 0, self.embed_tokens.shape[0]
        if parts[0] == "lm_head":
            return None if self.tie_word_embeddings else (self.lm_head.weight, 0, self.lm_head.weight.shape[0])
        if parts[0] == "norm":
            return self.norm.weight, 0, self.norm.weight.shape[0]
        if parts[0] != "layers":
            raise KeyError(name)
        layer = self.layers[int(parts[1])]
        module, proj, kind = parts[2], parts[3], parts[-1]
        if module.endswith("layernorm"):  # input_, post_attention_ (Gemma 3: pre_ and post_feedforward_ too)
            norm = getattr(layer, module)
            return norm.weight, 0, norm.weight.shape[0]
        if kind not in ("weight", "bias"):
            raise KeyError(name)
        if module == "self_attn" and proj == "rotary_emb":
            return None  # old checkpoints store inv_freq; we compute it
        if module == "self_attn" and proj in ("q_norm", "k_norm"):
            norm = getattr(layer.self_attn, proj)
            return norm.weight, 0, norm.weight.shape[0]
        if module == "self_attn":
            attn = layer.self_attn
            if proj == "o_proj":
                return getattr(attn.o_proj, kind), 0, attn.o_proj.weight.shape[0]
            offset = {"q_proj": 0, "k_proj": attn.q_size, "v_proj": attn.q_size + attn.kv_size}[proj]
            rows = attn.q_size if proj == "q_proj" else attn.kv_size
            return getattr(attn.qkv_proj, kind), offset, rows
        if module == "mlp":
            mlp = layer.mlp
            if proj == "down_proj":
                return mlp.down_proj.weight, 0, mlp.down_proj.weight.shape[0]
            offset = {"gate_proj": 0, "up_proj": mlp.intermediate}[proj]
            return mlp.gate_up_proj.weight, offset, mlp.intermediate
        raise KeyError(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors into the fused parameters; every parameter must be covered."""
        params = {id(p): n for n, p in self.named_parameters()}
        filled: dict[str, int] = {}
        for name, tensor in weights:
            try:
                target = self._target(name)
            except (KeyError, AttributeError, IndexError):
                raise ValueError(f"unexpected weight {name!r} in checkpoint (not a {self.arch} weight)") from None
            if target is None:
                continue
            param, offset, rows = target
            if param is None or tuple(tensor.shape) != (rows, *param.shape[1:]):
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, which does not fit this config")
            param.data[offset:offset + rows].copy_(tensor)
            key = params[id(param)]
            filled[key] = filled.get(key, 0) + rows
        missing = [n for n, p in self.named_parameters() if filled.get(n, 0) != p.shape[0]]
        if missing:
            raise ValueError(f"checkpoint lacks weights for {', '.join(missing[:5])}"
                             f"{' ...' if len(missing) > 5 else ''}")
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
