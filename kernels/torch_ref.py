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


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_start_loc: torch.Tensor | list[int], seq_lens: torch.Tensor | list[int],
                    scale: float) -> torch.Tensor:
    """Attention of a ragged batch of new query tokens over each request's paged history.

    query [num_tokens, num_heads, head_dim]; request b owns query rows
    [query_start_loc[b], query_start_loc[b+1]), which are the *last* tokens of its
    seq_lens[b] tokens, so query row j sits at position seq_len - q_len + j and attends
    causally to keys [0, that position]. Covers prefill, chunked prefill over a cached
    prefix, and decode (q_len == 1) alike. Returns [num_tokens, num_heads, head_dim].
    Requests with one query token (decode, most steps) share a single attention call.
    `query_start_loc` and `seq_lens` may be host lists (the attention backend passes those).
    """
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    starts = query_start_loc.tolist() if isinstance(query_start_loc, torch.Tensor) else list(query_start_loc)
    lens = seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else list(seq_lens)
    q_lens = [starts[b + 1] - starts[b] for b in range(len(lens))]
    singles = [b for b, q_len in enumerate(q_lens) if q_len == 1]
    if singles:
        _attend_single_queries(query, kv_cache, block_tables, [starts[b] for b in singles],
                               [lens[b] for b in singles], singles, scale, out)
    for b, seq_len in enumerate(lens):
        if q_lens[b] > 1:
            attend_request(query, kv_cache, block_tables[b], starts[b], q_lens[b], seq_len, scale, out)
    return out


def attend_request(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, q_start: int,
                   q_len: int, seq_len: int, scale: float, out: torch.Tensor,
                   new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Causal attention of one request's query rows [q_start, q_start + q_len), the last q_len of its
    seq_len tokens, into the same rows of `out`. `new_kv` (key, value rows of the same tokens) may be
    given when the request has no cached history (q_len == seq_len): attention then reads them
    instead of copying them back out of paged memory."""
    if new_kv is not None and q_len == seq_len:
        key, value = (t[q_start:q_start + q_len].to(query.dtype) for t in new_kv)
    else:
        kv = _gather_blocks(kv_cache, block_table[None], seq_len)[:, 0, :seq_len].to(query.dtype)
        key, value = kv[0], kv[1]
    k, v = key.transpose(0, 1).unsqueeze(0), value.transpose(0, 1).unsqueeze(0)  # [1, kv_heads, L, D]
    q = query[q_start:q_start + q_len].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
    if q_len == seq_len:  # no cached history: plain causal attention
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        mask = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    out[q_start:q_start + q_len] = o[0].transpose(0, 1)


def _gather_blocks(kv_cache: torch.Tensor, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
    """K and V of whole blocks, copied block by block: [2, num_reqs, padded_len, kv_heads, head_dim]."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    tables = block_tables[:, :-(-max_len // block_size)].clamp(min=0)
    kv = kv_cache.view(2, num_blocks, -1).index_select(1, tables.flatten().long())
    return kv.view(2, tables.shape[0], -1, num_kv_heads, head_dim)


def _attend_single_queries(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           rows: list[int], lens: list[int], batch: list[int], scale: float,
                           out: torch.Tensor) -> None:
    """One padded attention call for the requests in `batch`, each with one query row (its last token)."""
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    row_idx = torch.tensor(rows, device=query.device)
    kv = _gather_blocks(kv_cache, block_tables[torch.tensor(batch, device=query.device)], max(lens)).to(query.dtype)
    mask = None
    if min(lens) == max(lens):
        kv = kv[:, :, :lens[0]]
    else:
        lens_t = torch.tensor(lens, device=query.device)
        mask = (torch.arange(kv.shape[2], device=query.device)[None, :] < lens_t[:, None])[:, None, None, :]
    # Query heads sharing a KV head become that head's "query rows": no KV repetition needed.
    q = query[row_idx].view(len(batch), num_kv_heads, -1, head_dim)
    o = F.scaled_dot_product_attention(q, kv[0].transpose(1, 2), kv[1].transpose(1, 2), attn_mask=mask, scale=scale)
    out[row_idx] = o.reshape(len(batch), -1, head_dim)


def gather_kv(kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Copy the KV of the given slots into a contiguous [2, n, kv_heads, head_dim] buffer."""
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    return flat.index_select(1, slots.long())


def scatter_kv(kv_cache: torch.Tensor, slots: torch.Tensor, buf: torch.Tensor) -> None:
    """Write a [2, n, kv_heads, head_dim] buffer into the given slots."""
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    flat.index_copy_(1, slots.long(), buf.to(kv_cache.dtype))


def gather_kv_layers(kv_caches: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    """Copy the KV of the given slots of every layer into one [L, 2, n, kv_heads, head_dim] buffer."""
    return torch.stack([gather_kv(kv_cache, slots) for kv_cache in kv_caches])


def scatter_kv_layers(kv_caches: list[torch.Tensor], slots: torch.Tensor, buf: torch.Tensor) -> None:
    """Write an [L, 2, n, kv_heads, head_dim] buffer into the given slots of every layer."""
    if buf.shape[0] != len(kv_caches):
        raise ValueError(f"buffer has {buf.shape[0]} layers, cache has {len(kv_caches)}")
    for kv_cache, layer_buf in zip(kv_caches, buf):
        scatter_kv(kv_cache, slots, layer_buf)
