"""LMCache's GPU-connector interface implemented over our paged KV, on CPU and on CUDA.

LMCache moves KV between the serving engine and its memory objects through a "GPU connector";
the ones it ships require CUDA ("No supported cpu connector found") and vLLM's paged layout.
This one copies between our per-layer paged tensors [2, num_blocks, block_size, kv_heads,
head_dim] and LMCache's host memory objects in its KV_2LTD layout [2, num_layers, num_tokens,
kv_heads * head_dim]: all layers of a chunk move in one multi-layer gather/scatter launch, and
on CUDA through one host<->device copy of the chunk (synchronous, on LMCache's I/O thread; the
engine waits for the whole retrieve before layer 0, so ordering needs no events).

kwargs (passed through LMCacheEngine.store/retrieve): `kvcaches` (list of per-layer tensors),
`slot_mapping` (one slot per token of the whole sequence; < 0 = do not write that token) and
optionally `load_guard` (an object with `lock` and `failed`: a retrieve that lost its deadline
must not write into blocks the engine is already recomputing).
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryFormat, MemoryObj

from pdserve import kernels
class PagedKVCPUConnector(GPUConnectorInterface):
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.num_kv_heads * self.head_dim])

    def initialize_kvcaches_ptr(self, **kwargs: Any) -> None:
        """Nothing to register: the caches come with every call (`kvcaches`)."""

    @staticmethod
    def _args(kwargs: dict[str, Any]) -> tuple[list[torch.Tensor], torch.Tensor]:
        if "kvcaches" not in kwargs or "slot_mapping" not in kwargs:
            raise ValueError("PagedKVCPUConnector needs 'kvcaches' and 'slot_mapping' keyword arguments")
        return kwargs["kvcaches"], torch.as_tensor(kwargs["slot_mapping"], dtype=torch.long)

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        """Memory object -> paged KV for tokens [start, end) whose slot is >= 0."""
        kv_caches, slot_mapping = self._args(kwargs)
        slots = slot_mapping[start:end]
        keep = slots >= 0
        if not bool(keep.any()):
            return
        device = kv_caches[0].device
        # [2, L, n, H*D] -> [L, 2, n, H, D] rows of the kept tokens, on the cache's device
        rows = memory_obj.tensor[:, :, keep].transpose(0, 1).reshape(
            len(kv_caches), 2, -1, self.num_kv_heads, self.head_dim).to(device)
        guard = kwargs.get("load_guard")
        with guard.lock if guard is not None else contextlib.nullcontext():
            if guard is not None and guard.failed:
                return
            # Issued on the default stream, which the engine's layers also use: they run after it.
            kernels.scatter_kv_layers(kv_caches, slots[keep].to(device), rows)

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        """Paged KV of tokens [start, end) -> memory object (all slots must be valid)."""
        kv_caches, slot_mapping = self._args(kwargs)
        slots = slot_mapping[start:end]
        if bool((slots < 0).any()):
            raise ValueError(f"tokens [{start}, {end}) are not all in paged memory")
        rows = kernels.gather_kv_layers(kv_caches, slots.to(kv_caches[0].device))  # [L, 2, n, H, D]
        memory_obj.tensor.copy_(rows.reshape(len(kv_caches), 2, end - start, -1).transpose(0, 1))
        memory_obj.metadata.fmt = MemoryFormat.KV_2LTD

    def batched_to_gpu(self, memory_objs, starts, ends, **kwargs: Any) -> None:  # type: ignore[override]
        for memory_obj, start, end in zip(memory_objs, starts, ends):
            self.to_gpu(memory_obj, start, end, **kwargs)

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs: Any) -> None:  # type: ignore[override]
        for memory_obj, start, end in zip(memory_objs, starts, ends):
            self.from_gpu(memory_obj, start, end, **kwargs)
