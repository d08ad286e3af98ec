"""Paged-KV kernels: Triton (CUDA, or its interpreter in tests) and the torch reference.

The connectors call the transfer functions exported here (dispatched by device). The
attention kernels and the cache write are reached through the engine's attention backends
(engine/attention/backends), which import kernels.triton_attention / kernels.torch_ref.
"""
from pdserve.kernels.ops import (default_backend, gather_kv, gather_kv_layers, scatter_kv, scatter_kv_layers,
                         use_backend)

__all__ = ["default_backend", "gather_kv", "scatter_kv", "gather_kv_layers", "scatter_kv_layers", "use_backend"]
