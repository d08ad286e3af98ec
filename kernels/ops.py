"""Dispatch of the KV transfer kernels: CUDA tensors -> Triton, CPU tensors -> the torch reference.

The connectors move KV between paged memory and dense rows through these (gather/scatter, one
layer or all layers in one launch). Attention and the cache write of the step's new tokens go
through the engine's attention backend instead (engine/attention), which asks
`default_backend` here for its `auto` choice, so both follow one rule.

The choice can be forced with env PDSERVE_KERNELS=auto|triton|torch or, in-process, with
`with use_backend("triton"):` (common/kernel_choice.py owns both; re-exported here). Forcing
Triton on CPU tensors runs the kernels in Triton's interpreter, which is how CPU-only CI checks
them: TRITON_INTERPRET=1 must be set before the `kernels.triton_*` modules are first imported
(they are imported lazily, on first Triton use).
"""
from __future__ import annotations

import torch

from pdserve.common.kernel_choice import BACKENDS, requested_backend, use_backend
from pdserve.kernels import torch_ref

__all__ = ["BACKENDS", "requested_backend", "use_backend", "default_backend", "gather_kv", "scatter_kv",
           "gather_kv_layers", "scatter_kv_layers"]


def default_backend(device: torch.device) -> str:
    """'triton' or 'torch' for kernels on `device`: forced (use_backend, PDSERVE_KERNELS), else by device."""
    name = requested_backend()
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return name


def _use_triton(tensor: torch.Tensor) -> bool:
    return default_backend(tensor.device) == "triton"


def gather_kv(kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Copy the KV of the given slots into a contiguous [2, n, kv_heads, head_dim] buffer."""
    if _use_triton(kv_cache):
        from pdserve.kernels import triton_transfer
        return triton_transfer.gather_kv(kv_cache, slots)
    return torch_ref.gather_kv(kv_cache, slots)


def scatter_kv(kv_cache: torch.Tensor, slots: torch.Tensor, buf: torch.Tensor) -> None:
    """Write a [2, n, kv_heads, head_dim] buffer into the given slots."""
    if _use_triton(kv_cache):
        from pdserve.kernels import triton_transfer
        triton_transfer.scatter_kv(kv_cache, slots, buf)
    else:
        torch_ref.scatter_kv(kv_cache, slots, buf)


def gather_kv_layers(kv_caches: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    """Copy the KV of the given slots of every layer into one [L, 2, n, kv_heads, head_dim] buffer."""
    if _use_triton(kv_caches[0]):
        from pdserve.kernels import triton_transfer
        return triton_transfer.gather_kv_layers(kv_caches, slots)
    return torch_ref.gather_kv_layers(kv_caches, slots)


def scatter_kv_layers(kv_caches: list[torch.Tensor], slots: torch.Tensor, buf: torch.Tensor) -> None:
    """Write an [L, 2, n, kv_heads, head_dim] buffer into the given slots of every layer."""
    if _use_triton(kv_caches[0]):
        from pdserve.kernels import triton_transfer
        triton_transfer.scatter_kv_layers(kv_caches, slots, buf)
    else:
        torch_ref.scatter_kv_layers(kv_caches, slots, buf)
