"""Rank 0's commands to the other ranks as int64 tensors: an 8-entry header, then a payload (never pickle).

STEP carries the batch layout rank 0 flattened (engine/input_batch.py): token ids, positions, slots, query
starts, sequence lengths, block tables and the rows kept past the last layer (docs/architecture.md,
"Last-layer rows"). LOGITS asks the tensor-parallel ranks for their vocabulary columns of some hidden rows
(the rows follow as one broadcast in the model's dtype). COPY copies KV blocks; STOP ends the worker loop.
With a KV connector, STEP and CONNECTOR are followed by the connector's message as JSON bytes.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

HEADER = 8


class Command(enum.IntEnum):
    STOP = 0
    STEP = 1
    LOGITS = 2
    COPY = 3
    CONNECTOR = 4  # a step that computed nothing: the connectors' I/O only


def header(command: Command, *fields: int) -> torch.Tensor:
    h = torch.zeros(HEADER, dtype=torch.int64)
    h[0] = int(command)
    h[1:1 + len(fields)] = torch.tensor(fields, dtype=torch.int64)
    return h


@dataclass
class StepLayout:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: list[int]  # [num_reqs + 1]
    seq_lens: list[int]
    block_tables: torch.Tensor  # [num_reqs, width] int32
    keep_rows: torch.Tensor | None  # rows past the last layer's attention; None: all

    def encode(self, kv_bytes: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """`kv_bytes`: the length of the connector message (engine/parallel/kv_ranks.py) that follows."""
        num_reqs, width = self.block_tables.shape
        keep = self.keep_rows
        parts = [self.input_ids, self.positions, self.slot_mapping,
                 torch.tensor(self.query_start_loc, dtype=torch.int64), torch.tensor(self.seq_lens, dtype=torch.int64),
                 self.block_tables.reshape(-1)]
        if keep is not None:
            parts.append(keep)
        payload = torch.cat([p.to("cpu", torch.int64) for p in parts])
        h = header(Command.STEP, self.input_ids.numel(), num_reqs, width, -1 if keep is None else keep.numel(),
                   payload.numel(), kv_bytes)
        return h, payload

    @staticmethod
    def kv_bytes(h: torch.Tensor) -> int:
        return int(h[6])

    @staticmethod
    def payload_size(h: torch.Tensor) -> int:
        return int(h[5])

    @classmethod
    def decode(cls, h: torch.Tensor, payload: torch.Tensor) -> StepLayout:
        num_tokens, num_reqs, width, n_keep = (int(v) for v in h[1:5])
        cuts = [num_tokens, num_tokens, num_tokens, num_reqs + 1, num_reqs, num_reqs * width, max(n_keep, 0)]
        ids, pos, slots, qsl, lens, tables, keep = torch.split(payload, cuts)
        return cls(ids, pos, slots, qsl.tolist(), lens.tolist(), tables.to(torch.int32).view(num_reqs, width),
                   None if n_keep < 0 else keep)
