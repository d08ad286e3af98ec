"""Choose the engine's attention backend once, at start-up, from the device.

`auto` is the torch reference on CPU and Triton on CUDA (kernels.ops.default_backend, which
also honours PDSERVE_KERNELS). Naming one (`--attention-backend triton`) forces it; Triton on
CPU runs in Triton's interpreter, which only the tests want (TRITON_INTERPRET=1 must be set
before triton is imported).
"""
from __future__ import annotations

import importlib
import logging
import os

import torch

from engine.attention.backends.base import AttentionBackend
from engine.config import ATTENTION_BACKENDS
from kernels.ops import default_backend

logger = logging.getLogger(__name__)

# name -> "module:class"; imported on selection, so an unused backend costs nothing.
BACKEND_CLASSES = {
    "torch": "engine.attention.backends.torch_ref:TorchAttentionBackend",
    "triton": "engine.attention.backends.triton:TritonAttentionBackend",
}
assert set(BACKEND_CLASSES) | {"auto"} == set(ATTENTION_BACKENDS)


def backend_name(device: torch.device, requested: str = "auto") -> str:
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {requested!r}")
    name = default_backend(device) if requested == "auto" else requested
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the triton attention backend on CPU runs only in Triton's interpreter "
                         "(set TRITON_INTERPRET=1; it is slow and meant for tests); use --attention-backend torch")
    return name


def select_attention_backend(device: torch.device, requested: str = "auto") -> AttentionBackend:
    name = backend_name(device, requested)
    module, _, cls = BACKEND_CLASSES[name].partition(":")
    backend = getattr(importlib.import_module(module), cls)(device)
    logger.info("attention backend: %s on %s (%s)", name, device,
                "chosen from the device" if requested == "auto" else "forced")
    return backend
