"""The flattened batch as attention sees it, built once per step on the host.

Request b owns query rows [query_start_loc[b], query_start_loc[b+1]), which are the *last*
q_len tokens of its seq_lens[b] tokens. The model runner orders the batch so that the
requests with exactly one query token (decodes, and prompts whose last token is all that is
left) come first: rows [0, num_decodes) are those, the rest are prefill chunks. Device
tensors are what kernels read; the host copies (plain Python values) are what a backend
uses to choose kernels, grid sizes and splits without a device->host read inside a layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    # ---- on the engine's device ----
    slot_mapping: torch.Tensor  # [num_tokens] int64: paged slot of each new token (< 0: do not write)
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32, padded with 0
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32: tokens in the cache after this step
    # ---- on the host ----
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    num_decodes: int  # leading requests with exactly one query token
    max_query_len: int
    max_seq_len: int
    max_decode_seq_len: int  # over the decode requests (0 when there are none)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1] if self.query_start_loc_cpu else 0

    @property
    def num_prefills(self) -> int:
        return self.num_reqs - self.num_decodes


def build_attention_metadata(query_start_loc: list[int], seq_lens: list[int], block_tables: torch.Tensor,
                             slot_mapping: torch.Tensor, device: torch.device | None = None,
                             query_start_loc_dev: torch.Tensor | None = None,
                             seq_lens_dev: torch.Tensor | None = None) -> AttentionMetadata:
    """Metadata from host lists (decodes must come first); the device tensors are given or made here.

    The model runner passes the device tensors it copied from its pinned buffers; tests and
    benchmarks pass only lists and let this function place them on `device`.
    """
    q_lens = [query_start_loc[b + 1] - query_start_loc[b] for b in range(len(seq_lens))]
    num_decodes = 0
    while num_decodes < len(q_lens) and q_lens[num_decodes] == 1:
        num_decodes += 1
    if any(q == 1 for q in q_lens[num_decodes:]):
        raise ValueError("requests with one query token must come first in the batch")
    device = device or block_tables.device
    if query_start_loc_dev is None:
        query_start_loc_dev = torch.tensor(query_start_loc, dtype=torch.int32, device=device)
    if seq_lens_dev is None:
        seq_lens_dev = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return AttentionMetadata(
        slot_mapping=slot_mapping, block_tables=block_tables, query_start_loc=query_start_loc_dev,
        seq_lens=seq_lens_dev, query_start_loc_cpu=list(query_start_loc), seq_lens_cpu=list(seq_lens),
        num_decodes=num_decodes, max_query_len=max(q_lens, default=0), max_seq_len=max(seq_lens, default=0),
        max_decode_seq_len=max(seq_lens[:num_decodes], default=0))
