"""Random-weight PEFT LoRA adapters made with `peft` itself, and HF + PEFT greedy generation: the
independent oracle of the engine's LoRA path (docs/lora.md)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: Path, out: Path, r: int = 8, alpha: float = 16, targets: list[str] | None = None,
                 seed: int = 1, use_rslora: bool = False, strength: float = 1.0) -> Path:
    """A PEFT adapter directory (adapter_config.json + adapter_model.safetensors) for the base checkpoint,
    with A and B drawn so the adapter's delta is about `strength` times the base layer's output scale."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets or ALL_LINEAR, lora_dropout=0.0,
                        use_rslora=use_rslora)
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    scaling = alpha / (math.sqrt(r) if use_rslora else r)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name:  # rows of unit norm: x A^T keeps x's scale
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
            elif "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * (strength / math.sqrt(p.shape[1]) / scaling))
    peft_model.save_pretrained(str(out))
    return out


def edit_config(adapter: Path, **changes) -> Path:
    path = adapter / "adapter_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))
    return adapter


def hf_peft_greedy(base: Path, adapter: Path | None, prompts: list[list[int]], max_tokens: int = 12) -> list[list[int]]:
    """HF generate under the adapter (None: the base model), one prompt at a time, fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            seq = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long))
            outs.append(seq[0, len(ids):].tolist())
    return outs


def adapter_set(base: Path, root: Path) -> dict[str, Path]:
    """The adapters the LoRA tests share: rank 8 and rank 64 (rsLoRA) on every linear layer, and rank 16 on
    q and v only; `a2` has `a`'s config with other weights (a reused name must not share KV)."""
    return {
        "a": make_adapter(base, root / "a", r=8, alpha=16, seed=1),
        "b": make_adapter(base, root / "b", r=64, alpha=32, seed=2, use_rslora=True),
        "qv": make_adapter(base, root / "qv", r=16, alpha=8, targets=["q_proj", "v_proj"], seed=3, strength=2.0),
        "a2": make_adapter(base, root / "a2", r=8, alpha=16, seed=4),
    }
