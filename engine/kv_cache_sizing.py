"""How much memory the paged KV cache gets: `--kv-cache-memory` bytes, or `--gpu-memory-utilization F`.

With F (CUDA only; the CUDA default is 0.9 when neither option is given) the engine may use
F x the device's memory in all. What the weights, the activations of one profiled max-batch
forward and the memory taken outside torch's allocator (CUDA context growth, library
workspaces) use is subtracted; the rest is the KV cache, as vLLM users expect. The
arithmetic is logged at start-up.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.config import DEFAULT_GPU_MEMORY_UTILIZATION, DEFAULT_KV_CACHE_MEMORY, CacheConfig
from pdserve.engine.device import Platform

GIB = 2**30


@dataclass(frozen=True)
class MemorySnapshot:
    """Device memory as seen before the engine allocates anything (CUDA only)."""

    used: int  # by everything on the device (other processes, this process's earlier engines)
    reserved: int  # by this process's torch allocator
    allocated: int

    @classmethod
    def take(cls, platform: Platform) -> MemorySnapshot:
        torch.cuda.synchronize(platform.device)
        free, total = platform.memory_info()
        return cls(total - free, torch.cuda.memory_reserved(platform.device),
                   torch.cuda.memory_allocated(platform.device))


@dataclass(frozen=True)
class GpuMemoryProfile:
    total: int
    utilization: float
    weights: int
    activations: int  # peak growth over the weights during the profiled forward
    non_torch: int  # device memory taken during start-up outside torch's allocator
    free: int  # free on the device after profiling
    profiled: str  # what the profiled forward was, for the log line

    @property
    def kv_budget(self) -> int:
        return int(self.utilization * self.total) - self.weights - self.activations - self.non_torch

    def describe(self) -> str:
        return (f"KV cache memory: {self.utilization:.2f} x {self.total / GIB:.2f} GiB = "
                f"{self.utilization * self.total / GIB:.2f} GiB for this engine - {self.weights / GIB:.2f} GiB "
                f"weights - {self.activations / GIB:.2f} GiB peak activations ({self.profiled}) - "
                f"{self.non_torch / GIB:.2f} GiB outside torch = {self.kv_budget / GIB:.2f} GiB for KV")

    def check(self, device: torch.device) -> None:
        if self.kv_budget <= 0:
            raise ValueError(f"{self.describe()}: nothing is left for the KV cache; raise gpu_memory_utilization "
                             f"or lower max_num_batched_tokens")
        if self.kv_budget > self.free:
            raise ValueError(f"{self.describe()}, but only {self.free / GIB:.2f} GiB are free on {device} (other "
                             f"processes hold the rest); lower gpu_memory_utilization or give kv_cache_memory")


def measure_profile(platform: Platform, before_load: MemorySnapshot, after_load_allocated: int, peak_allocated: int,
                    utilization: float, profiled: str) -> GpuMemoryProfile:
    """The profile from the snapshot taken before loading and the allocator's figures since."""
    torch.cuda.synchronize(platform.device)
    torch.cuda.empty_cache()  # activations go back to the device: `free` must count them as free
    free, total = platform.memory_info()
    reserved = torch.cuda.memory_reserved(platform.device)
    non_torch = max(0, (total - free - before_load.used) - (reserved - before_load.reserved))
    return GpuMemoryProfile(total=total, utilization=utilization,
                            weights=after_load_allocated - before_load.allocated,
                            activations=max(0, peak_allocated - after_load_allocated), non_torch=non_torch,
                            free=free, profiled=profiled)


def fixed_budget(cache: CacheConfig, platform: Platform) -> int | None:
    """The KV bytes when no profiling is needed (kv_cache_memory, or the CPU default); None: profile."""
    if cache.kv_cache_memory is not None:
        return cache.kv_cache_memory
    if not platform.is_cuda:
        if cache.gpu_memory_utilization is not None:
            raise ValueError("gpu_memory_utilization sizes the KV cache of a CUDA device; on CPU give "
                             "kv_cache_memory (e.g. 2GiB)")
        return DEFAULT_KV_CACHE_MEMORY
    return None


def utilization(cache: CacheConfig) -> float:
    return cache.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
