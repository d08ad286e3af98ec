"""pdserve engine: paged KV cache, scheduler, model runner and sampler; no HTTP, gRPC or store client.

The KV connector interface lives here (engine.kv_connector); its implementations live in
`connectors/` and are handed in by the layer above (serving), so the engine never imports
them. The offline API is `from pdserve import LLM, SamplingParams`.

The heavy names (they pull in torch and transformers) load on first use, so importing a light
submodule such as `engine.config` stays cheap.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLMEngine": "pdserve.engine.llm_engine",
    "StepOutput": "pdserve.engine.outputs",
    "EngineStats": "pdserve.engine.outputs",
    "SamplingParams": "pdserve.engine.sampling_params",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
