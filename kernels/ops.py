"""Dispatch of each kernel by device (the Triton path is added by the kernels issue)."""
from __future__ import annotations

from kernels import torch_ref

reshape_and_cache = torch_ref.reshape_and_cache
paged_attention = torch_ref.paged_attention
gather_kv = torch_ref.gather_kv
scatter_kv = torch_ref.scatter_kv
