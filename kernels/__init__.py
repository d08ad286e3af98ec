"""Paged-KV kernels behind one interface: Triton on CUDA, the torch reference on CPU.

The engine and the connectors call only the functions exported here.
"""
from kernels.ops import (gather_kv, gather_kv_layers, paged_attention, reshape_and_cache, scatter_kv,
                         scatter_kv_layers, use_backend)

__all__ = ["reshape_and_cache", "paged_attention", "gather_kv", "scatter_kv", "gather_kv_layers",
           "scatter_kv_layers", "use_backend"]
