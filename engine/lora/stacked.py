"""The batched LoRA path: every slot's adapter stacked per linear layer, one compiled call (CPU) or a few torch
ops per layer.

Grouping rows by adapter (layers.add_lora) costs a gather, a matmul per part and an indexed write per
adapter per layer: with 4 adapters on a decode step of a small model those thousands of small torch ops
cost more than the base step itself. Here each wrapped layer holds every slot's pairs stacked (LoRAStack),
written only when a slot's adapter changes, and a step needs per row only its slot and scaling (RowSlots).

On CPU, when kernels/csrc/cpu_lora.c builds, one call per layer does it all (kernels/cpu_lora.py: shrink and
expand of each row by its own slot's pairs only, bf16 x read and y written in place with one rounding). Else
(CUDA, no compiler, PDSERVE_KERNELS=torch) torch does: t = x A^T for every part and slot in one bmm, scaled
per row and slot (zero in the other slots' columns, all zero for the base model's rows), then per part
y[:, part] += t_part Bt_part, in fp32, rounded once to y's dtype: 4 + parts ops per layer whatever the
adapter count. The torch stack is part-major because the expand reads every B each step and memory bandwidth
is what a decode step of it costs: a slot-major [out, slots * parts * r] B would be 1/2 (gate_up) to 2/3
(qkv) zeros.

Both equal add_lora's within fp32 rounding, not bit for bit: the scaling multiplies t rather than t B^T, and
the sums run in another order than a rank-r matmul's. Greedy tokens still match HF + PEFT (tests/engine/lora/).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from pdserve.common.native_build import build_or_none
from pdserve.engine.lora.adapter import LoRAModule
from pdserve.kernels.cpu_lora import LoRAKernel, LoRAWeights

_KERNEL_DTYPES = (torch.bfloat16, torch.float32)


def lora_kernel() -> LoRAKernel | None:
    """The compiled kernel, or None (the torch path runs; build_or_none says why once)."""
    return build_or_none("cpu_lora", LoRAKernel, "multi-LoRA decode rows run as torch ops")


@dataclass
class RowSlots:
    """One step's rows on the batched path: each row's slot (-1: the base model) and its adapter's scaling,
    int32 and fp32 on the CPU (what the kernel reads); only slots below `used` take part."""

    slot: torch.Tensor
    scaling: torch.Tensor
    used: int
    device: torch.device

    @functools.cached_property
    def table(self) -> torch.Tensor:
        """[rows, used] on the device: each row's scaling in its slot's column (the torch path multiplies by it)."""
        table = torch.zeros(len(self.slot), self.used + 1)  # column `used`: where the base model's rows write 0
        column = torch.where(self.slot < 0, self.used, self.slot).long()
        table.scatter_(1, column[:, None], self.scaling[:, None])
        return table[:, :self.used].to(self.device)

    @classmethod
    def of_table(cls, table: torch.Tensor) -> RowSlots:
        """From a [rows, slots] table (each row's scaling in its slot's column, zero elsewhere)."""
        device, table = table.device, table.cpu().float()
        nonzero = table != 0
        slot = torch.where(nonzero.any(1), nonzero.int().argmax(1), -1)
        scaling = table.gather(1, slot.clamp(min=0)[:, None])[:, 0] * (slot >= 0)
        return cls(slot.to(torch.int32), scaling.contiguous(), table.shape[1], device)


class LoRAStack:
    """One linear layer's slots, r = max_lora_rank. With the kernel (CPU): `weights`, its layout
    (kernels/cpu_lora.py). Else part-major so that no part's expand reads another part's zeros:
    A [parts, slots * r, in] and per part Bt [slots * r, that part's output width] (fp32, on the device);
    slot s's rank rows of a part at [s*r, s*r + its rank)."""

    def __init__(self, slots: int, rank: int, in_features: int, widths: tuple[int, ...],
                 device: torch.device, dtype: torch.dtype = torch.float32) -> None:
        self.rank = rank
        self.columns = tuple((sum(widths[:p]), w) for p, w in enumerate(widths))  # each part's (offset, width)
        self.kernel = lora_kernel() if device.type == "cpu" else None
        self.weights: LoRAWeights | None = None
        if self.kernel is not None:
            # bf16 adapter weights (`--lora-dtype`) stay bf16 in the kernel's layout: half the bytes a step reads;
            # other dtypes' values, already rounded, are exact in fp32
            self.weights = LoRAWeights(slots, rank, in_features, widths,
                                       torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
            return
        self.a = torch.zeros(len(widths), slots * rank, in_features, device=device)
        self.bt = [torch.zeros(slots * rank, w, device=device) for w in widths]

    def write(self, slot: int, module: LoRAModule | None) -> None:
        """Put one adapter's pairs (None: it does not target this layer) into `slot`, clearing what was there."""
        offsets = [offset for offset, _ in self.columns]
        parts = module.parts if module is not None else ()
        if self.weights is not None:
            self.weights.clear(slot)
            for part in parts:
                assert module is not None
                self.weights.put(slot, offsets.index(part.offset), module.a[part.rank_start:part.rank_end], part.b)
            return
        block = slice(slot * self.rank, (slot + 1) * self.rank)
        self.a[:, block].zero_()
        for bt in self.bt:
            bt[block].zero_()
        for part in parts:
            assert module is not None
            p, rank = offsets.index(part.offset), part.rank_end - part.rank_start
            self.a[p, block.start:block.start + rank].copy_(module.a[part.rank_start:part.rank_end])
            self.bt[p][block.start:block.start + rank].copy_(part.b.t())


def add_lora_stacked(y: torch.Tensor, x: torch.Tensor, stack: LoRAStack, rows: RowSlots | torch.Tensor) -> None:
    """y += each row's ((x A^T) * scaling) B^T per part of its slot, in fp32, in place, rounded once into y's
    dtype. `rows`: a RowSlots, or its [rows, slots used] table. Only the first `used` slots take part (the
    manager fills the lowest free slot first)."""
    if isinstance(rows, torch.Tensor):
        rows = RowSlots.of_table(rows)
    if stack.kernel is not None and stack.weights is not None:
        if y.dtype in _KERNEL_DTYPES and x.dtype in _KERNEL_DTYPES:
            stack.kernel(y, x, rows.slot, rows.scaling, stack.weights)
        else:  # e.g. fp16: the kernel adds in fp32; the copy back is the one rounding
            out = y.float()
            stack.kernel(out, x.float(), rows.slot, rows.scaling, stack.weights)
            y.copy_(out)
        return
    scale = rows.table
    n, slots = scale.shape
    width = slots * stack.rank
    t = torch.matmul(x.float(), stack.a[:, :width].transpose(1, 2))  # [parts, n, width]: one bmm
    t.view(-1, n, slots, stack.rank).mul_(scale.view(1, n, slots, 1))
    out = y if y.dtype == torch.float32 else y.float()  # one rounding into y's dtype, as PEFT adds its delta
    for p, (offset, w) in enumerate(stack.columns):
        out[:, offset:offset + w].addmm_(t[p], stack.bt[p][:width])
    if out is not y:
        y.copy_(out)
