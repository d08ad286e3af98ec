"""pdserve: prefill/decode disaggregated LLM serving with an external KV store.

Everything installs under this one name: `pdserve.engine`, `pdserve.kvstore`, `pdserve.serving`, ...
In the repository those packages are the top-level folders (`engine/`, `kvstore/`, ...);
pyproject.toml maps them under `pdserve.` for the wheel. Run from a checkout without installing
(PYTHONPATH=the checkout, as on a machine with its own torch), this package also looks in the
checkout's root, so `pdserve.engine` is `engine/` there too.

`from pdserve import LLM, SamplingParams` loads the engine on first use only, so importing a light
subpackage (the proxy, the protocol) stays cheap.
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

__version__ = "0.1.0"

_CHECKOUT = Path(__file__).resolve().parent.parent
if (_CHECKOUT / "pyproject.toml").is_file() and (_CHECKOUT / "engine" / "__init__.py").is_file():
    __path__.append(str(_CHECKOUT))  # type: ignore[name-defined]  # noqa: F821 (a package's own __path__)

_OFFLINE_API = ("LLM", "SamplingParams", "LoRARequest")  # where each lives: pdserve.serving's own lazy exports
__all__ = [*_OFFLINE_API, "__version__"]


def __getattr__(name: str) -> Any:
    if name not in _OFFLINE_API:
        raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
    return getattr(importlib.import_module("pdserve.serving"), name)
