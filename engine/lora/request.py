"""LoRARequest: which adapter a prompt runs under (vLLM's `vllm.lora.request.LoRARequest`)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """`lora_name` names the adapter (what a server lists), `lora_int_id` (>= 1) identifies it within an
    engine, `lora_path` is its PEFT directory (adapter_config.json + adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None  # vLLM's field: the served model it applies to (informational)

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r} needs lora_path (a PEFT directory)")

    # vLLM's aliases
    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path
