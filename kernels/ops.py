"""Dispatch of each kernel: CUDA tensors -> Triton, CPU tensors -> the torch reference.

The backend can be forced with env PDSERVE_KERNELS=auto|triton|torch or, in-process, with
`with use_backend("triton"):`. Forcing Triton on CPU tensors runs the kernels in Triton's
interpreter, which is how CPU-only CI checks them: TRITON_INTERPRET=1 must be set before the
`kernels.triton_*` modules are first imported (they are imported lazily, on first Triton use).
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

import torch

from kernels import torch_ref

BACKENDS = ("auto", "triton", "torch")
_forced: list[str] = []


@contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Force a backend for the calls made inside the block (any thread), then restore."""
    _check(name, "use_backend")
    _forced.append(name)
    try:
        yield
    finally:
        _forced.pop()


def _check(name: str, source: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{source}: unknown kernel backend {name!r}; expected one of {', '.join(BACKENDS)}")
    return name


def _use_triton(tensor: torch.Tensor) -> bool:
    name = _forced[-1] if _forced else _check(os.environ.get("PDSERVE_KERNELS", "auto"), "PDSERVE_KERNELS")
    if name == "auto":
        return tensor.is_cuda
    return name == "triton"


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write key/value [n, kv_heads, head_dim] into their slots; slots < 0 are skipped."""
    if _use_triton(kv_cache):
        from kernels import triton_transfer
        triton_transfer.reshape_and_cache(key, value, kv_cache, slot_mapping)
    else:
        torch_ref.reshape_and_cache(key, value, kv_cache, slot_mapping)


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Ragged causal attention over paged history (see torch_ref.paged_attention).

    On Triton, a pure-decode batch (every q_len == 1) takes the decode kernel, anything
    else the context kernel; telling them apart reads max(q_len) on the host.
    """
    if not _use_triton(query):
        return torch_ref.paged_attention(query, kv_cache, block_tables, query_start_loc, seq_lens, scale)
    from kernels import triton_attention
    max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if seq_lens.numel() else 0
    if max_query_len == 1 and query.shape[0] == seq_lens.numel():
        return triton_attention.paged_decode_attention(query, kv_cache, block_tables, query_start_loc,
                                                       seq_lens, scale)
    return triton_attention.context_attention(query, kv_cache, block_tables, query_start_loc, seq_lens,
                                              scale, max_query_len)


def gather_kv(kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Copy the KV of the given slots into a contiguous [2, n, kv_heads, head_dim] buffer."""
    if _use_triton(kv_cache):
        from kernels import triton_transfer
        return triton_transfer.gather_kv(kv_cache, slots)
    return torch_ref.gather_kv(kv_cache, slots)


def scatter_kv(kv_cache: torch.Tensor, slots: torch.Tensor, buf: torch.Tensor) -> None:
    """Write a [2, n, kv_heads, head_dim] buffer into the given slots."""
    if _use_triton(kv_cache):
        from kernels import triton_transfer
        triton_transfer.scatter_kv(kv_cache, slots, buf)
    else:
        torch_ref.scatter_kv(kv_cache, slots, buf)


def gather_kv_layers(kv_caches: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    """Copy the KV of the given slots of every layer into one [L, 2, n, kv_heads, head_dim] buffer."""
    if _use_triton(kv_caches[0]):
        from kernels import triton_transfer
        return triton_transfer.gather_kv_layers(kv_caches, slots)
    return torch_ref.gather_kv_layers(kv_caches, slots)


def scatter_kv_layers(kv_caches: list[torch.Tensor], slots: torch.Tensor, buf: torch.Tensor) -> None:
    """Write an [L, 2, n, kv_heads, head_dim] buffer into the given slots of every layer."""
    if _use_triton(kv_caches[0]):
        from kernels import triton_transfer
        triton_transfer.scatter_kv_layers(kv_caches, slots, buf)
    else:
        torch_ref.scatter_kv_layers(kv_caches, slots, buf)
