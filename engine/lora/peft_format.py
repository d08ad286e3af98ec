"""Reading a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors) into a LoRAAdapter.

Only plain LoRA on the linear layers the engine has (q/k/v/o, gate/up/down) is served; anything that
would change the math without our computing it (DoRA, trained biases, modules_to_save, per-module rank
or alpha patterns, fan_in_fan_out, embeddings or lm_head) is refused with a LoRAError naming it, never
silently ignored.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from pdserve.common.hashing import adapter_fingerprint
from pdserve.engine.lora.adapter import PEFT_MODULES, LoRAAdapter, LoRAError, LoRAModule, LoRAPart, TargetLayout
from pdserve.engine.lora.request import LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
# config entries that change the math; each must be absent or say "nothing"
_REFUSED = {"use_dora": "DoRA (use_dora)", "modules_to_save": "modules_to_save", "rank_pattern": "rank_pattern",
            "alpha_pattern": "alpha_pattern", "fan_in_fan_out": "fan_in_fan_out",
            "target_parameters": "target_parameters", "trainable_token_indices": "trainable_token_indices"}


def stamp(path: str) -> tuple[Any, ...]:
    """The directory's files as they are now (size, mtime): a cached adapter whose stamp changed is re-read."""
    out = []
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        try:
            st = (Path(path) / name).stat()
            out.append((name, st.st_size, st.st_mtime_ns))
        except OSError:
            out.append((name, None, None))
    return tuple(out)


def read_config(path: str, max_rank: int) -> dict[str, Any]:
    root = Path(path)
    if not root.is_dir():
        raise LoRAError(f"LoRA adapter directory {path} does not exist or is not a directory")
    try:
        cfg = json.loads((root / CONFIG_FILE).read_text())
    except OSError:
        raise LoRAError(f"LoRA adapter {path} has no readable {CONFIG_FILE}") from None
    except json.JSONDecodeError as e:
        raise LoRAError(f"LoRA adapter {path}: {CONFIG_FILE} is not JSON ({e})") from None
    if not isinstance(cfg, dict) or str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise LoRAError(f"LoRA adapter {path}: peft_type {cfg.get('peft_type') if isinstance(cfg, dict) else cfg!r} "
                        "is not LORA")
    for key, what in _REFUSED.items():
        if cfg.get(key):
            raise LoRAError(f"LoRA adapter {path}: {what} is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoRAError(f"LoRA adapter {path}: bias={cfg['bias']!r} is not supported (only 'none')")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1 or not isinstance(alpha, (int, float)):
        raise LoRAError(f"LoRA adapter {path}: r and lora_alpha must be numbers (r an integer >= 1)")
    if r > max_rank:
        raise LoRAError(f"LoRA adapter {path} has rank {r}, above max_lora_rank={max_rank}")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        unsupported = sorted(set(targets) - set(PEFT_MODULES))
        if unsupported:
            raise LoRAError(f"LoRA adapter {path}: target modules {', '.join(unsupported)} are not supported "
                            f"(supported: {', '.join(PEFT_MODULES)})")
    return cfg


def read_adapter(request: LoRARequest, layout: TargetLayout, max_rank: int,
                 dtype: torch.dtype = torch.float32) -> LoRAAdapter:
    """The adapter at `request.lora_path`, checked against the base model's shapes; LoRAError otherwise. Its
    weights are rounded to `dtype` (`--lora-dtype`) and kept in fp32, so every path computes with the same values;
    the rounding enters the fingerprint (KV made with rounded weights is another adapter's KV)."""
    path = request.lora_path
    cfg = read_config(path, max_rank)
    r, alpha, rslora = cfg["r"], float(cfg["lora_alpha"]), bool(cfg.get("use_rslora", False))
    read = _read_pairs(path, layout, r)
    pairs = read if dtype == torch.float32 else {
        key: (a.to(dtype).float(), b.to(dtype).float()) for key, (a, b) in read.items()}
    modules: dict[tuple[int, str], LoRAModule] = {}
    grouped: dict[tuple[int, str], list[tuple[str, torch.Tensor, torch.Tensor]]] = {}
    for (layer, peft_module), (a, b) in sorted(pairs.items()):
        grouped.setdefault((layer, PEFT_MODULES[peft_module][1]), []).append((peft_module, a, b))
    for key, members in grouped.items():
        parts, start = [], 0
        for peft_module, a, b in members:
            _, offset, rows = layout.shape_of(peft_module)
            parts.append(LoRAPart(offset, rows, start, start + a.shape[0], b))
            start += a.shape[0]
        modules[key] = LoRAModule(torch.cat([a for _, a, _ in members]), tuple(parts))
    ident: dict[str, object] = {"r": r, "lora_alpha": alpha, "use_rslora": rslora}
    if dtype != torch.float32:  # (fp32's fingerprints stay what they were)
        ident["weights_dtype"] = str(dtype).removeprefix("torch.")
    tensors = [(f"{layer}.{m}.{ab}", t.contiguous().view(torch.uint8).numpy().tobytes())
               for (layer, m), pair in sorted(read.items()) for ab, t in zip("AB", pair)]
    return LoRAAdapter(name=request.lora_name, int_id=request.lora_int_id, path=path, rank=r,
                       scaling=alpha / (math.sqrt(r) if rslora else r), fingerprint=adapter_fingerprint(ident, tensors),
                       modules=modules, target_modules=tuple(sorted({m for _, m in pairs})), stamp=stamp(path),
                       num_bytes=sum(len(data) for _, data in tensors))


def _read_pairs(path: str, layout: TargetLayout, r: int) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, PEFT module) -> (A [r, in], B [out, r]) in fp32, every shape checked."""
    file = Path(path) / WEIGHTS_FILE
    if not file.is_file():
        raise LoRAError(f"LoRA adapter {path} has no {WEIGHTS_FILE} (only safetensors adapters are supported)")
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                m = _KEY.search(name)
                if m is None or m.group(3) not in PEFT_MODULES or PEFT_MODULES[m.group(3)][0] != m.group(2):
                    raise LoRAError(f"LoRA adapter {path}: weight {name!r} is not a LoRA pair on a supported "
                                    f"linear layer ({', '.join(PEFT_MODULES)})")
                halves.setdefault((int(m.group(1)), m.group(3)), {})[m.group(4)] = f.get_tensor(name).float()
    except LoRAError:
        raise
    except Exception as e:  # a truncated or foreign file
        raise LoRAError(f"LoRA adapter {path}: cannot read {WEIGHTS_FILE} ({type(e).__name__}: {e})") from None
    if not halves:
        raise LoRAError(f"LoRA adapter {path}: {WEIGHTS_FILE} holds no LoRA weights")
    pairs = {}
    for (layer, module), ab in halves.items():
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"LoRA adapter {path}: layer {layer} {module} lacks lora_{'A' if 'A' not in ab else 'B'}")
        if layer >= layout.num_layers:
            raise LoRAError(f"LoRA adapter {path}: layer {layer} does not exist (the model has {layout.num_layers})")
        in_features, _, rows = layout.shape_of(module)
        a, b = ab["A"], ab["B"]
        if tuple(a.shape) != (r, in_features) or tuple(b.shape) != (rows, r):
            raise LoRAError(f"LoRA adapter {path}: layer {layer} {module} has A {tuple(a.shape)} and B "
                            f"{tuple(b.shape)}; this model needs ({r}, {in_features}) and ({rows}, {r}) "
                            "(an adapter for another base model?)")
        pairs[(layer, module)] = (a, b)
    return pairs
