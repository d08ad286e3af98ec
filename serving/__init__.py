"""pdserve serving: the entry points, everything between a user (or the proxy) and the engine.

The offline `LLM`, the OpenAI protocol, HTTP server (`pd-serve`), node gRPC servicer and
launcher, command-line options and Prometheus metrics live here, so `engine/` stays free of
HTTP, gRPC and Prometheus. This is also the layer that picks a KV connector from
`connectors/` and hands it to the engine. Layout and import rules: docs/architecture.md.

`from pdserve.serving import LLM, SamplingParams` loads the engine on first use only, so the proxy can
import serving's protocol without it.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"LLM": "pdserve.serving.llm", "SamplingParams": "pdserve.engine.sampling_params",
            "LoRARequest": "pdserve.engine.lora.request"}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'serving' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
