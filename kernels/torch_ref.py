"""Torch reference implementations of the paged-KV kernels: the CPU path and the test oracle.

Layout (one tensor per layer): kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim],
index 0 = keys, 1 = values. A slot is `block_id * block_size + offset`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write key/value [n, kv_heads, head_dim] into their slots; slots < 0 are skipped."""
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    flat[0].index_copy_(0, slot_mapping.long(), key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping.long(), value.to(kv_cache.dtype))


def _slots_of(block_table_row: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(seq_len, device=block_table_row.device)
    return block_table_row[pos // block_size].long() * block_size + pos % block_size


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of a ragged batch of new query tokens over each request's paged history.

    query [num_tokens, num_heads, head_dim]; request b owns query rows
    [query_start_loc[b], query_start_loc[b+1]), which are the *last* tokens of its
    seq_lens[b] tokens, so query row j sits at position seq_len - q_len + j and attends
    causally to keys [0, that position]. Covers prefill, chunked prefill over a cached
    prefix, and decode (q_len == 1) alike. Returns [num_tokens, num_heads, head_dim].
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    group = num_heads // num_kv_heads
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        q_start, q_end = starts[b], starts[b + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        slots = _slots_of(block_tables[b], seq_len, block_size)
        k = flat[0].index_select(0, slots).to(query.dtype)  # [L, kv_heads, D]
        v = flat[1].index_select(0, slots).to(query.dtype)
        q = query[q_start:q_end].transpose(0, 1)  # [H, q_len, D]
        k = k.transpose(0, 1).repeat_interleave(group, dim=0)  # [H, L, D]
        v = v.transpose(0, 1).repeat_interleave(group, dim=0)
        mask = None
        if q_len > 1:
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
            mask = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out[q_start:q_end] = o.transpose(0, 1)
    return out


def gather_kv(kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Copy the KV of the given slots into a contiguous [2, n, kv_heads, head_dim] buffer."""
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    return flat.index_select(1, slots.long())


def scatter_kv(kv_cache: torch.Tensor, slots: torch.Tensor, buf: torch.Tensor) -> None:
    """Write a [2, n, kv_heads, head_dim] buffer into the given slots."""
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    flat.index_copy_(1, slots.long(), buf.to(kv_cache.dtype))
