"""Choose the engine's attention backend once, at start-up, from the device.

`auto` is Triton on CUDA and, on CPU, the compiled CPU kernel (engine/attention/backends/cpu.py),
or the torch reference when its library cannot be had there (common/native_build.py: one warning).
Forcing the kernels to torch (PDSERVE_KERNELS=torch or kernels.ops.use_backend, as the tests'
oracle runs do) makes `auto` the torch reference; PDSERVE_KERNELS=triton makes it Triton.
Naming one (`--attention-backend torch|cpu|triton`) forces it; Triton on CPU runs in Triton's
interpreter, which only the tests want (TRITON_INTERPRET=1 must be set before triton is imported).
"""
from __future__ import annotations

import importlib
import logging
import os

import torch

from pdserve.engine.attention.backends.base import AttentionBackend
from pdserve.engine.config import ATTENTION_BACKENDS
from pdserve.common.native_build import BuildError, log_fallback
from pdserve.kernels.ops import default_backend, requested_backend

logger = logging.getLogger(__name__)

# name -> "module:class"; imported on selection, so an unused backend costs nothing.
BACKEND_CLASSES = {
    "torch": "pdserve.engine.attention.backends.torch_ref:TorchAttentionBackend",
    "cpu": "pdserve.engine.attention.backends.cpu:CpuAttentionBackend",
    "triton": "pdserve.engine.attention.backends.triton:TritonAttentionBackend",
}
assert set(BACKEND_CLASSES) | {"auto"} == set(ATTENTION_BACKENDS)


def backend_name(device: torch.device, requested: str = "auto") -> str:
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {requested!r}")
    name = default_backend(device) if requested == "auto" else requested
    if requested == "auto" and device.type == "cpu" and requested_backend() == "auto":
        name = "cpu"
    if name == "cpu" and device.type != "cpu":
        raise ValueError(f"the cpu attention backend runs on CPU tensors only, not on {device}")
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the triton attention backend on CPU runs only in Triton's interpreter "
                         "(set TRITON_INTERPRET=1; it is slow and meant for tests); use --attention-backend torch")
    return name


def select_attention_backend(device: torch.device, requested: str = "auto") -> AttentionBackend:
    name = backend_name(device, requested)
    try:
        backend = _construct(name, device)
    except BuildError as exc:
        if requested != "auto":
            raise
        log_fallback("the CPU attention kernel", exc, "using the torch reference, which copies KV blocks out of "
                     "paged memory in every layer")
        name, backend = "torch", _construct("torch", device)
    logger.info("attention backend: %s on %s (%s)", name, device,
                "chosen from the device" if requested == "auto" else "forced")
    return backend


def _construct(name: str, device: torch.device) -> AttentionBackend:
    module, _, cls = BACKEND_CLASSES[name].partition(":")
    return getattr(importlib.import_module(module), cls)(device)
