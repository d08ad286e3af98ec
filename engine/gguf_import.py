"""A llama.cpp GGUF file -> a Hugging Face checkpoint directory (config, safetensors, tokenizer).

The weights are read with the `gguf` package and dequantized to fp32, then cast to the requested
dtype. Only `general.architecture == "llama"` files are taken (Llama, Mistral and SmolLM-style
models as llama.cpp writes them). llama.cpp's converter permutes the rows of each q/k projection
so that RoPE rotates adjacent pairs; our models and transformers rotate the two halves of a head,
so those rows are put back (`_unpermute`). The tokenizer and chat template come from the file's
own metadata through transformers' GGUF tokenizer converter.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

SUPPORTED_ARCHITECTURES = ("llama",)
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _float(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def hf_config(reader: Any) -> dict[str, Any]:
    """config.json's fields from the GGUF metadata (a Llama config)."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")

    def meta(name: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{name}", default)

    heads = int(meta("attention.head_count"))
    hidden = int(meta("embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = meta("vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "vocab_size": int(vocab), "hidden_size": hidden, "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", heads)),
        "head_dim": int(meta("rope.dimension_count", hidden // heads)),
        "max_position_embeddings": int(meta("context_length")),
        "rms_norm_eps": _float(meta("attention.layer_norm_rms_epsilon")),
        "rope_parameters": {"rope_type": "default", "rope_theta": _float(meta("rope.freq_base", 10000.0))},
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": False, "mlp_bias": False,
    }
    for key in ("bos", "eos", "padding"):
        token = _field(reader, f"tokenizer.ggml.{key}_token_id")
        if token is not None:
            config[f"{'pad' if key == 'padding' else key}_token_id"] = int(token)
    return config


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: (head, dim/2, 2) rows back to (head, 2, dim/2)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_weights(reader: Any, config: dict[str, Any], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor, dequantized to fp32, renamed to transformers' names, q/k rows restored, cast to dtype."""
    from gguf.quants import dequantize

    out: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = tensor.name
        if name.startswith("blk."):
            _, layer, rest = name.split(".", 2)
            hf_name = f"model.layers.{int(layer)}.{_LAYER_NAMES[rest]}" if rest in _LAYER_NAMES else None
        else:
            hf_name = _TOP_NAMES.get(name)
        if hf_name is None:
            if name.startswith("rope_"):  # llama.cpp's precomputed rope factors: we compute ours
                continue
            raise ValueError(f"GGUF tensor {name!r} has no Llama counterpart")
        # numpy shape is the reverse of GGUF's (ne0 is the fastest dimension): [out, in], as torch's.
        # np.array copies: F32 tensors come back as read-only views of the file's memory map.
        w = torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))
        if hf_name.endswith("q_proj.weight"):
            w = _unpermute(w, config["num_attention_heads"])
        elif hf_name.endswith("k_proj.weight"):
            w = _unpermute(w, config["num_key_value_heads"])
        if config["tie_word_embeddings"] and hf_name == "lm_head.weight":
            continue
        out[hf_name] = w.to(dtype).contiguous()
    return out


def convert(gguf_file: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "bfloat16",
            extra_config: dict[str, Any] | None = None) -> Path:
    """Write config.json, generation_config.json, model.safetensors and the tokenizer (with the chat
    template the file carries) into out_dir; returns out_dir."""
    import gguf
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    if dtype not in ("bfloat16", "float32", "float16"):
        raise ValueError(f"dtype {dtype!r} is not one of bfloat16, float32, float16")
    src, out = Path(gguf_file), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(str(src))
    config = {**hf_config(reader), "dtype": dtype, **(extra_config or {})}
    save_file(hf_weights(reader, config, getattr(torch, dtype)), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name, local_files_only=True)
    tokenizer.save_pretrained(str(out))
    return out
