"""Triton paged attention: decode (one query token per sequence) and context (ragged, causal).

Both launch one flash-attention kernel whose program owns a tile of query *rows*, where a row
is one (query token, query head) pair of a single KV head's GQA group. Packing the group's
heads into the rows loads each K/V tile once per KV head instead of once per query head,
which is what makes decode (a single token, so only `group` rows) worth a tensor-core dot.
- decode: one token per program, grid (num_seqs, num_splits, kv_heads). With num_splits > 1
  (flash-decoding) each program covers one slice of the sequence's keys and writes its partial
  output and log-sum-exp; `_reduce_splits_kernel` combines them. Long contexts with few
  sequences would otherwise leave most of the GPU's SMs idle;
- context: BLOCK_Q tokens per program, grid (num_seqs, q_tiles, kv_heads); query row j of a
  request sits at position seq_len - q_len + j and sees keys [0, that position] — new tokens
  are causal among themselves and see the whole paged prefix (chunked prefill, KV-hit decode).
Keys are visited in BLOCK_N-token tiles through the block table, so any power-of-two
block size works; head dims that are not powers of two (80, 96) are padded and masked.
Every launch takes its grid from host values (the attention metadata), never from a
device->host read. The tl.* calls used are those of Triton 3.x (3.6 on the GPU machine).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pdserve.kernels.launch import launch_guard

_LOG2E = math.log2(math.e)
_MIN_ROWS = 16  # tl.dot needs at least 16 rows
_CONTEXT_ROWS = 64  # rows (tokens x group heads) per context program
_BLOCK_N = 64  # keys per inner-loop tile
_SPLIT_MIN_TOKENS = 256  # keys per decode split at least: below that a split is not worth its reduce
_MAX_SPLITS = 64


def num_kv_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """KV splits per decode sequence: enough programs to fill the SMs twice, none shorter than
    _SPLIT_MIN_TOKENS keys. 1 (no split) when the batch alone fills the GPU or contexts are short."""
    programs = num_seqs * num_kv_heads
    if programs >= 2 * num_sms:
        return 1
    wanted = triton.cdiv(2 * num_sms, programs)
    return max(1, min(wanted, max_seq_len // _SPLIT_MIN_TOKENS, _MAX_SPLITS))


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    partial_ptr, lse_ptr, kv_split_len, scale_log2,
    stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od,
    stride_cb, stride_cs, stride_ch, stride_cd, stride_bt,
    stride_ps, stride_ph, stride_pk, stride_ls, stride_lh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, SPLIT_KV: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(2)
    if SPLIT_KV:  # decode: axis 1 is the KV split, one query token per sequence
        q_tile = 0
        split = tl.program_id(1)
    else:  # axis 1 is the query tile
        q_tile = tl.program_id(1)
        split = 0
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        rows = tl.arange(0, BLOCK_M)
        q_idx = q_tile * BLOCK_Q + rows // GROUP_PAD
        head = kv_head * GROUP + rows % GROUP_PAD
        row_ok = (rows < BLOCK_Q * GROUP_PAD) & (rows % GROUP_PAD < GROUP) & (q_idx < q_len)
        q_pos = seq_len - q_len + q_idx
        dim = tl.arange(0, BLOCK_D)
        dim_ok = dim < HEAD_DIM
        q_tok = (q_start + q_idx).to(tl.int64)
        q = tl.load(q_ptr + q_tok[:, None] * stride_qt + head[:, None] * stride_qh + dim[None, :] * stride_qd,
                    mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(DOT_DTYPE)

        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # Keys after this tile's last query position are never visible: stop there.
        kv_end = tl.minimum(seq_len, seq_len - q_len + (q_tile + 1) * BLOCK_Q)
        kv_start = 0
        if SPLIT_KV:
            kv_start = split * kv_split_len
            kv_end = tl.minimum(kv_end, kv_start + kv_split_len)
        bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
        for start in range(kv_start, kv_end, BLOCK_N):
            tok = start + tl.arange(0, BLOCK_N)
            tok_ok = tok < kv_end
            block = tl.load(bt_row + tok // BLOCK_SIZE, mask=tok_ok, other=0).to(tl.int64)
            kv_off = (block * stride_cb + (tok % BLOCK_SIZE) * stride_cs + kv_head * stride_ch)[:, None] \
                + dim[None, :] * stride_cd
            kv_mask = tok_ok[:, None] & dim_ok[None, :]
            k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(DOT_DTYPE)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
            s = tl.where(tok_ok[None, :] & (tok[None, :] <= q_pos[:, None]), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(DOT_DTYPE)
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=PRECISION)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        if SPLIT_KV:
            # Partial output of this key slice and its log2-sum-exp2 (-1e30: an empty slice weighs 0).
            seq64 = seq.to(tl.int64)
            lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), -1.0e30)
            tl.store(lse_ptr + seq64 * stride_ls + head * stride_lh + split, lse, mask=row_ok)
            tl.store(partial_ptr + seq64 * stride_ps + head[:, None] * stride_ph + split * stride_pk + dim[None, :],
                     out, mask=row_ok[:, None] & dim_ok[None, :])
        else:
            tl.store(out_ptr + q_tok[:, None] * stride_ot + head[:, None] * stride_oh + dim[None, :] * stride_od,
                     out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _reduce_splits_kernel(
    partial_ptr, lse_ptr, out_ptr, query_start_loc_ptr, num_splits,
    stride_ps, stride_ph, stride_pk, stride_ls, stride_lh, stride_ot, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """out[row of seq, head] = sum over splits of partial * softmax weight of the split's lse."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    split = tl.arange(0, BLOCK_S)
    split_ok = split < num_splits
    lse = tl.load(lse_ptr + seq * stride_ls + head * stride_lh + split, mask=split_ok, other=-1.0e30)
    weight = tl.exp2(lse - tl.max(lse, 0))
    weight = weight / tl.sum(weight, 0)
    dim = tl.arange(0, BLOCK_D)
    dim_ok = dim < HEAD_DIM
    part = tl.load(partial_ptr + seq * stride_ps + head * stride_ph + split[:, None] * stride_pk + dim[None, :],
                   mask=split_ok[:, None] & dim_ok[None, :], other=0.0)
    out = tl.sum(part * weight[:, None], 0)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + dim * stride_od, out.to(out_ptr.dtype.element_ty),
             mask=dim_ok)


def _dot_dtype(dtype: torch.dtype, on_gpu: bool) -> tl.dtype:
    """Operand dtype of the two tl.dot calls: the query's own, except bf16 off-GPU, where Triton's
    interpreter multiplies bf16 bit patterns as integers (3.9), so it gets fp32 operands instead."""
    if dtype == torch.bfloat16:
        return tl.bfloat16 if on_gpu else tl.float32
    return tl.float16 if dtype == torch.float16 else tl.float32


def _launch(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
            query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float, out: torch.Tensor | None,
            block_q: int, num_q_tiles: int, num_splits: int = 1, max_seq_len: int = 0) -> torch.Tensor:
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size {block_size} is not a power of two")
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_seqs = block_tables.shape[0]
    if num_seqs == 0 or query.shape[0] == 0:
        return out
    split_kv = num_splits > 1
    block_d = max(16, triton.next_power_of_2(head_dim))
    if split_kv:
        # Whole BLOCK_N tiles per split, so no tile straddles two splits.
        kv_split_len = triton.cdiv(triton.cdiv(max_seq_len, num_splits), _BLOCK_N) * _BLOCK_N
        partial = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
        lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
        grid = (num_seqs, num_splits, num_kv_heads)
    else:
        kv_split_len, partial, lse = 0, out, out  # unused by the kernel without SPLIT_KV
        grid = (num_seqs, num_q_tiles, num_kv_heads)
    dot_dtype = _dot_dtype(query.dtype, query.is_cuda)
    with launch_guard(query.device):
        _paged_attention_kernel[grid](
            query, kv_cache[0], kv_cache[1], out, block_tables, query_start_loc, seq_lens,
            partial, lse, kv_split_len, scale * _LOG2E,
            *query.stride(), *out.stride(), *kv_cache.stride()[1:], block_tables.stride(0),
            *(partial.stride()[:3] if split_kv else (0, 0, 0)), *(lse.stride()[:2] if split_kv else (0, 0)),
            GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, BLOCK_D=block_d,
            BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_M=max(_MIN_ROWS, block_q * group_pad), BLOCK_N=_BLOCK_N,
            DOT_DTYPE=dot_dtype, PRECISION="ieee" if dot_dtype == tl.float32 else "tf32", SPLIT_KV=split_kv,
        )
        if split_kv:
            _reduce_splits_kernel[(num_seqs, num_heads)](
                partial, lse, out, query_start_loc, num_splits,
                *partial.stride()[:3], *lse.stride()[:2], *out.stride(),
                HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(num_splits),
            )
    return out


def paged_decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None, num_splits: int = 1,
                           max_seq_len: int = 0) -> torch.Tensor:
    """Attention of one new token per sequence over its paged KV; the rows are query_start_loc[:-1].

    num_splits > 1 splits each sequence's keys into that many slices (flash-decoding);
    max_seq_len (a host value, >= every seq_len) sizes the slices."""
    if num_splits > 1 and max_seq_len < 1:
        raise ValueError("a split decode needs max_seq_len, the longest sequence of the batch")
    return _launch(query, kv_cache, block_tables, query_start_loc, seq_lens, scale, out,
                   block_q=1, num_q_tiles=1, num_splits=num_splits, max_seq_len=max_seq_len)


def context_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                      max_query_len: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Ragged causal attention of each request's new tokens over its paged prefix and themselves."""
    group_pad = triton.next_power_of_2(query.shape[1] // kv_cache.shape[3])
    block_q = max(1, _CONTEXT_ROWS // group_pad)
    return _launch(query, kv_cache, block_tables, query_start_loc, seq_lens, scale, out,
                   block_q=block_q, num_q_tiles=triton.cdiv(max_query_len, block_q))
