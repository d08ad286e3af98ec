"""One step's model inputs: built once on the host, copied to the device without blocking.

The scheduler's batch is flattened into one "super sequence" (docs/architecture.md, §7): token
ids, positions, the paged slot of every new token, block tables, query start offsets and
sequence lengths, plus the rows whose logits are sampled. The host fills persistent buffers
(pinned on CUDA, engine/device.py) with numpy, then starts one non-blocking copy per buffer;
nothing here reads device memory. Requests with a single query token are ordered first so
the attention backend can give them the decode kernel (engine/attention/metadata.py).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.engine.attention.metadata import AttentionMetadata, build_attention_metadata
from pdserve.engine.device import HostDeviceBuffer, Platform
from pdserve.engine.request import Request
from pdserve.engine.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] on the device
    positions: torch.Tensor  # [num_tokens] on the device
    attn_metadata: AttentionMetadata
    requests: list[Request]  # batch order (single-token requests first)
    sample_rows: list[int]  # batch rows whose last token's logits are sampled
    logits_indices: torch.Tensor  # [len(sample_rows)] token rows of those logits, on the device


class InputBatchBuilder:
    """Persistent host/device buffers sized for the largest step; they grow if a step is larger."""

    def __init__(self, platform: Platform, block_size: int, max_num_tokens: int, max_num_reqs: int,
                 max_blocks_per_req: int) -> None:
        self.platform = platform
        self.block_size = block_size
        self._sizes = {"tokens": max_num_tokens, "reqs": max_num_reqs, "blocks": max_num_reqs * max_blocks_per_req}
        self._buffers: dict[str, HostDeviceBuffer] = {}
        self._allocate()
        # Host buffers are refilled next step only after this step's copies out of them finished.
        self._copied = platform.new_event()

    _LAYOUT = {  # buffer -> (size key, extra elements, dtype)
        "input_ids": ("tokens", 0, torch.int64), "positions": ("tokens", 0, torch.int64),
        "slot_mapping": ("tokens", 0, torch.int64), "query_start_loc": ("reqs", 1, torch.int32),
        "seq_lens": ("reqs", 0, torch.int32), "logits_indices": ("reqs", 0, torch.int64),
        "block_tables": ("blocks", 0, torch.int32),
    }

    def _allocate(self) -> None:
        for name, (key, extra, dtype) in self._LAYOUT.items():
            self._buffers[name] = self.platform.host_device_buffer(self._sizes[key] + extra, dtype)
        self._np = {name: buf.host.numpy() for name, buf in self._buffers.items()}

    def _ensure(self, num_tokens: int, num_reqs: int, num_blocks: int) -> None:
        wanted = {"tokens": num_tokens, "reqs": num_reqs, "blocks": num_blocks}
        if all(wanted[k] <= self._sizes[k] for k in wanted):
            return
        self._copied.synchronize()
        self._sizes = {k: max(self._sizes[k], wanted[k]) for k in wanted}
        logger.info("step input buffers grown to %d tokens, %d requests, %d block-table entries",
                    self._sizes["tokens"], self._sizes["reqs"], self._sizes["blocks"])
        self._allocate()

    def prepare(self, so: SchedulerOutput) -> StepInputs:
        n_of = so.num_scheduled_tokens
        # Single-token requests first (stable): rows [0, num_decodes) take the decode kernel.
        requests = sorted(so.scheduled_requests, key=lambda r: n_of[r.request_id] != 1)
        num_reqs = len(requests)
        num_new = np.fromiter((n_of[r.request_id] for r in requests), dtype=np.int64, count=num_reqs)
        starts = np.fromiter((r.num_computed_tokens for r in requests), dtype=np.int64, count=num_reqs)
        tables = [so.block_tables[r.request_id] for r in requests]
        width = max(len(t) for t in tables)
        num_tokens = int(num_new.sum())
        self._ensure(num_tokens, num_reqs, num_reqs * width)
        self._copied.synchronize()  # the previous step's copies have left the host buffers
        h = self._np

        qsl = h["query_start_loc"][:num_reqs + 1]
        qsl[0] = 0
        np.cumsum(num_new, out=qsl[1:])
        seq_lens = starts + num_new
        h["seq_lens"][:num_reqs] = seq_lens
        bt = h["block_tables"][:num_reqs * width].reshape(num_reqs, width)
        bt.fill(0)
        ids = h["input_ids"]
        for b, (req, table) in enumerate(zip(requests, tables)):
            bt[b, :len(table)] = table
            start, end = int(starts[b]), int(seq_lens[b])
            ids[qsl[b]:qsl[b + 1]] = req.all_token_ids[start:end]
        req_of_token = np.repeat(np.arange(num_reqs), num_new)
        positions = h["positions"][:num_tokens]
        np.subtract(np.arange(num_tokens), qsl[:-1][req_of_token], out=positions)
        positions += starts[req_of_token]
        slots = h["slot_mapping"][:num_tokens]
        np.multiply(bt[req_of_token, positions // self.block_size], self.block_size, out=slots)
        slots += positions % self.block_size
        sample_rows = [b for b, r in enumerate(requests) if seq_lens[b] == r.num_tokens]
        h["logits_indices"][:len(sample_rows)] = qsl[1:][sample_rows] - 1

        buf = self._buffers
        dev_bt = buf["block_tables"].to_device(num_reqs * width).view(num_reqs, width)
        meta = build_attention_metadata(
            qsl.tolist(), seq_lens.tolist(), dev_bt, buf["slot_mapping"].to_device(num_tokens),
            query_start_loc_dev=buf["query_start_loc"].to_device(num_reqs + 1),
            seq_lens_dev=buf["seq_lens"].to_device(num_reqs))
        inputs = StepInputs(input_ids=buf["input_ids"].to_device(num_tokens),
                            positions=buf["positions"].to_device(num_tokens), attn_metadata=meta,
                            requests=requests, sample_rows=sample_rows,
                            logits_indices=buf["logits_indices"].to_device(len(sample_rows)))
        self._copied.record()
        return inputs
