"""The LoRA adapters a server serves by name (vLLM's --lora-modules, /v1/load_lora_adapter,
/v1/unload_lora_adapter): the request's `model` picks one, `/v1/models` lists them under the base model.

The engine keeps the adapters' weights (engine/lora/manager.py); this table only maps served names to
LoRARequests, each load with a new lora_int_id, so a name reused for other weights is another adapter.
"""
from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.lora.request import LoRARequest
from pdserve.serving.protocol_fields import APIError, bad_request, model_not_found


def parse_lora_module(text: str) -> tuple[str, str]:
    """An argparse type: `name=path`, or vLLM's JSON form {"name": ..., "path": ...}."""
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"--lora-modules JSON is invalid: {e}") from None
        name, path = (spec.get("name"), spec.get("path")) if isinstance(spec, dict) else (None, None)
    else:
        name, _, path = text.partition("=")
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise argparse.ArgumentTypeError(f"expected name=path or {{\"name\": ..., \"path\": ...}}, got {text!r}")
    return name, path


parse_lora_module.__name__ = "LoRA module"


@dataclass
class ServedLoRAs:
    """Served adapter names -> their LoRARequests; `enabled` False when the engine has no LoRA."""

    base_names: list[str]
    enabled: bool = False
    adapters: dict[str, LoRARequest] = field(default_factory=dict)
    _ids: Any = field(default_factory=lambda: itertools.count(1))

    def request_for(self, name: str, path: str) -> LoRARequest:
        """A LoRARequest for a new adapter under `name` (not yet served: `add` it once the engine loaded it)."""
        if not self.enabled:
            raise bad_request("LoRA adapters are not enabled on this server (start it with --enable-lora)",
                              "lora_name")
        if name in self.adapters or name in self.base_names:
            raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        return LoRARequest(name, next(self._ids), path, base_model_name=self.base_names[0])

    def add(self, request: LoRARequest) -> None:
        self.adapters[request.lora_name] = request

    def remove(self, name: str) -> LoRARequest:
        """The adapter served as `name`, no longer served; vLLM's 404 when there is none."""
        request = self.adapters.pop(name, None)
        if request is None:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", type="NotFoundError",
                           param="lora_name", code="lora_not_found")
        return request

    def resolve(self, model: str | None) -> tuple[str, LoRARequest | None]:
        """The name to answer with and the adapter a request's `model` picks (None: the base model); vLLM's
        404 for a name served by neither."""
        if model is None or model in self.base_names:
            return model or self.base_names[0], None
        if model in self.adapters:
            return model, self.adapters[model]
        raise model_not_found(model, [*self.base_names, *self.adapters])

    def model_cards(self) -> list[dict[str, Any]]:
        """The adapters as /v1/models lists them (vLLM's shape: root is the adapter's path, parent the base)."""
        return [{"id": name, "object": "model", "owned_by": "pdserve", "root": r.lora_path,
                 "parent": self.base_names[0]} for name, r in self.adapters.items()]


def served_loras(engine: Any, base_names: list[str]) -> ServedLoRAs:
    """The table of a server over `engine` (an LLMEngine): the adapters it loaded at start-up (--lora-modules),
    new ids after theirs."""
    manager = engine.model_runner.lora
    table = ServedLoRAs(base_names, enabled=manager is not None)
    adapters = manager.loaded() if manager is not None else []
    for adapter in adapters:
        table.add(LoRARequest(adapter.name, adapter.int_id, adapter.path, base_model_name=base_names[0]))
    table._ids = itertools.count(max((a.int_id for a in adapters), default=0) + 1)
    return table


def startup_requests(modules: list[tuple[str, str]]) -> list[LoRARequest]:
    """--lora-modules as LoRARequests (ids 1..n); a name given twice is an error."""
    names = [name for name, _ in modules]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"--lora-modules names {', '.join(twice)} more than once")
    return [LoRARequest(name, i, path) for i, (name, path) in enumerate(modules, 1)]


def lora_body(body: bytes, need_path: bool) -> tuple[str, str | None]:
    """`lora_name` (and `lora_path`) of a load/unload body; 400 for anything else."""
    try:
        data = json.loads(body or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise bad_request("the body must be a JSON object with lora_name" + (" and lora_path" if need_path else ""))
    name = data.get("lora_name") if isinstance(data, dict) else None
    path = data.get("lora_path") if isinstance(data, dict) else None
    if not isinstance(name, str) or not name or (need_path and (not isinstance(path, str) or not path)):
        raise bad_request("Both 'lora_name' and 'lora_path' must be provided." if need_path
                          else "'lora_name' must be provided.", "lora_name")
    return name, path
