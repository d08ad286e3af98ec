"""Model registry: HF `architectures` name -> our paged-KV implementation."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pdserve.engine.models.gemma3 import Gemma3ForCausalLM
from pdserve.engine.models.llama import LlamaForCausalLM
from pdserve.engine.parallel.group import ModelShard

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}


def get_model_class(hf_config: Any) -> type[nn.Module]:
    """The implementation for the config's architecture; a one-line error for anything else."""
    archs = getattr(hf_config, "architectures", None) or []
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(f"unsupported model architecture {', '.join(archs) or '(none in config.json)'}; "
                     f"supported: {', '.join(MODEL_REGISTRY)}")


def build_model(hf_config: Any, dtype: torch.dtype, max_positions: int | None = None,
                shard: ModelShard | None = None) -> nn.Module:
    """`shard` (engine/parallel): this rank's layers and tensor-parallel ops; None builds the whole model."""
    return get_model_class(hf_config)(hf_config, dtype, max_positions, shard)
