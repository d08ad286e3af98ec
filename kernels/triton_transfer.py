"""Triton kernels that move KV between paged slots and dense token rows.

One kernel serves three jobs, because each is "copy the K and V of n tokens between
slot `slots[t]` of a paged cache and row `t` of a dense tensor":
- reshape_and_cache: the step's new key/value [n, kv_heads, head_dim] -> slots (slots < 0 skipped),
- gather_kv / gather_kv_layers: slots -> a contiguous [2, n, ...] (or [L, 2, n, ...]) buffer,
- scatter_kv / scatter_kv_layers: such a buffer -> slots.
The multi-layer variants copy every layer in one launch through a table of per-layer cache
addresses, so a connector moving a chunk of a 32-layer model issues one launch, not 32.
"""
from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from pdserve.kernels.launch import launch_guard

# Elements one program copies per K/V tile; large tiles keep the interpreter's program count low.
_TILE_ELEMS = 4096


@triton.jit
def _kv_slot_copy_kernel(
    cache_ptr,  # cache tensor, or (LAYERED) int64 table of per-layer cache addresses
    dense_k_ptr, dense_v_ptr, slot_ptr, num_tokens,
    stride_dl, stride_dt, stride_dh, stride_dd,  # dense rows: layer, token, head, dim
    stride_ckv, stride_cb, stride_cs, stride_ch, stride_cd,  # cache: k/v, block, offset, head, dim
    CACHE_DTYPE: tl.constexpr, LAYERED: tl.constexpr, TO_CACHE: tl.constexpr,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_HD: tl.constexpr,
):
    layer = tl.program_id(1)
    if LAYERED:
        cache = tl.load(cache_ptr + layer).to(tl.pointer_type(CACHE_DTYPE))
    else:
        cache = cache_ptr
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_ptr + tok, mask=tok < num_tokens, other=-1).to(tl.int64)
    tok_ok = slot >= 0
    hd = tl.arange(0, BLOCK_HD)
    head = hd // HEAD_DIM
    dim = hd % HEAD_DIM
    mask = tok_ok[:, None] & (hd < NUM_HEADS * HEAD_DIM)[None, :]
    cache_off = ((slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs)[:, None] \
        + (head * stride_ch + dim * stride_cd)[None, :]
    dense_off = layer.to(tl.int64) * stride_dl + tok.to(tl.int64)[:, None] * stride_dt \
        + (head * stride_dh + dim * stride_dd)[None, :]
    k_cache = cache + cache_off
    v_cache = cache + stride_ckv + cache_off
    if TO_CACHE:
        k = tl.load(dense_k_ptr + dense_off, mask=mask)
        v = tl.load(dense_v_ptr + dense_off, mask=mask)
        tl.store(k_cache, k.to(CACHE_DTYPE), mask=mask)
        tl.store(v_cache, v.to(CACHE_DTYPE), mask=mask)
    else:
        k = tl.load(k_cache, mask=mask)
        v = tl.load(v_cache, mask=mask)
        tl.store(dense_k_ptr + dense_off, k, mask=mask)
        tl.store(dense_v_ptr + dense_off, v, mask=mask)


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@lru_cache(maxsize=64)
def _address_table(addresses: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Per-layer cache addresses on the device; cached because the cache tensors live for the
    whole run, so the host-to-device copy happens once, not per transfer."""
    return torch.tensor(addresses, dtype=torch.int64, device=device)


def _strides(t: torch.Tensor) -> tuple[int, ...]:
    """Strides that matter: a size-1 dim is only ever indexed at 0, whatever its stride."""
    return tuple(st for st, size in zip(t.stride(), t.shape) if size > 1)


def _launch(cache: torch.Tensor, layers: list[torch.Tensor] | None, dense_k: torch.Tensor,
            dense_v: torch.Tensor, slots: torch.Tensor, to_cache: bool) -> None:
    """Copy n tokens' K/V between `slots` of the cache(s) and dense rows.

    dense_k/dense_v are [L, n, kv_heads, head_dim] views sharing strides (L == 1 when
    `layers` is None); `cache` is the (first) layer's [2, blocks, block_size, heads, dim] tensor.
    """
    if _strides(dense_k) != _strides(dense_v):
        raise ValueError("key and value rows must share strides")
    if cache.dtype not in _TL_DTYPES:
        raise ValueError(f"unsupported KV cache dtype {cache.dtype}")
    num_layers, num_tokens, num_heads, head_dim = dense_k.shape
    if num_tokens == 0:
        return
    slots = slots.contiguous()
    block_hd = triton.next_power_of_2(num_heads * head_dim)
    block_t = max(1, min(64, _TILE_ELEMS // block_hd))
    if layers is None:
        cache_arg = cache
    else:
        cache_arg = _address_table(tuple(t.data_ptr() for t in layers), cache.device)
    grid = (triton.cdiv(num_tokens, block_t), num_layers)
    with launch_guard(cache.device):
        _kv_slot_copy_kernel[grid](
            cache_arg, dense_k, dense_v, slots, num_tokens,
            *dense_k.stride(), *cache.stride(),
            CACHE_DTYPE=_TL_DTYPES[cache.dtype], LAYERED=layers is not None, TO_CACHE=to_cache,
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_SIZE=cache.shape[2],
            BLOCK_T=block_t, BLOCK_HD=block_hd,
        )


def _check_layers(kv_caches: list[torch.Tensor]) -> torch.Tensor:
    """All layers must share shape, dtype, strides and device: one kernel indexes them alike."""
    if not kv_caches:
        raise ValueError("kv_caches is empty")
    first = kv_caches[0]
    for t in kv_caches[1:]:
        if (t.shape, t.dtype, t.stride(), t.device) != (first.shape, first.dtype, first.stride(), first.device):
            raise ValueError("all layers' KV caches must share shape, dtype, strides and device")
    return first


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write key/value [n, kv_heads, head_dim] into their slots; slots < 0 are skipped."""
    if _strides(key) != _strides(value):
        key, value = key.contiguous(), value.contiguous()
    _launch(kv_cache, None, key.unsqueeze(0), value.unsqueeze(0), slot_mapping, to_cache=True)


def gather_kv(kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Copy the KV of the given slots into a contiguous [2, n, kv_heads, head_dim] buffer."""
    buf = kv_cache.new_empty((2, slots.numel(), *kv_cache.shape[3:]))
    _launch(kv_cache, None, buf[0:1], buf[1:2], slots, to_cache=False)
    return buf


def scatter_kv(kv_cache: torch.Tensor, slots: torch.Tensor, buf: torch.Tensor) -> None:
    """Write a [2, n, kv_heads, head_dim] buffer into the given slots."""
    _launch(kv_cache, None, buf[0:1], buf[1:2], slots, to_cache=True)


def gather_kv_layers(kv_caches: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    """Copy the KV of the given slots of every layer into one [L, 2, n, kv_heads, head_dim] buffer."""
    first = _check_layers(kv_caches)
    buf = first.new_empty((len(kv_caches), 2, slots.numel(), *first.shape[3:]))
    _launch(first, kv_caches, buf[:, 0], buf[:, 1], slots, to_cache=False)
    return buf


def scatter_kv_layers(kv_caches: list[torch.Tensor], slots: torch.Tensor, buf: torch.Tensor) -> None:
    """Write an [L, 2, n, kv_heads, head_dim] buffer into the given slots of every layer."""
    first = _check_layers(kv_caches)
    if buf.shape[0] != len(kv_caches):
        raise ValueError(f"buffer has {buf.shape[0]} layers, cache has {len(kv_caches)}")
    _launch(first, kv_caches, buf[:, 0], buf[:, 1], slots, to_cache=True)
