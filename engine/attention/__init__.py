"""Paged attention: the layer, the per-step metadata, and the backends that compute it.

- `AttentionMetadata` (metadata.py): the step's batch layout, device tensors plus the host
  values backends choose kernels from; built once per step by the model runner.
- `AttentionBackend` (backends/base.py): `forward(query, key, value, kv_cache, meta, scale)`
  writes the new K/V into paged memory and attends; chosen once per engine by
  `select_attention_backend` (selector.py): the compiled CPU kernel on CPU (torch reference as
  fallback and oracle), Triton on CUDA.
- `PagedAttention` (layer.py): the model's attention layer; reads the `ForwardContext` the
  runner sets around each forward pass and calls the KV connector's per-layer hooks.
"""
from pdserve.engine.attention.backends.base import AttentionBackend
from pdserve.engine.attention.layer import ForwardContext, PagedAttention, get_forward_context, set_forward_context
from pdserve.engine.attention.metadata import AttentionMetadata, build_attention_metadata
from pdserve.engine.attention.selector import backend_name, select_attention_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "ForwardContext", "PagedAttention", "backend_name",
           "build_attention_metadata", "get_forward_context", "select_attention_backend", "set_forward_context"]
