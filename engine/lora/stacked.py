"""The batched LoRA path: every slot's adapter in one stacked A and B per linear layer, a few ops per layer.

Grouping rows by adapter (layers.add_lora) costs a gather, a matmul per part and an indexed write per
adapter per layer: with 4 adapters on a decode step of a small model those thousands of small torch ops
cost more than the base step itself. Here each wrapped layer holds every slot's pairs stacked (LoRAStack;
zero wherever a slot's adapter has nothing), written only when a slot's adapter changes. A step then needs
per row only its slot's scaling (zero in the other slots' columns, all zero for the base model's rows):
t = x A^T for every part and slot in one bmm, scaled per row and slot, then per part
y[:, part] += t_part Bt_part, in fp32, rounded once to y's dtype: 4 + parts ops per layer whatever the
adapter count. The stack is part-major because the expand reads every B each step and memory bandwidth is
what a decode step of it costs: a slot-major [out, slots * parts * r] B would be 1/2 (gate_up) to 2/3 (qkv)
zeros.

The result equals add_lora's within fp32 rounding, not bit for bit: the scaling multiplies t rather than
t B^T, and the expand's reduction runs over slots * r columns (the other slots' exact zeros) with another
blocking than a rank-r matmul. Greedy tokens still match HF + PEFT (tests/engine/lora/).
"""
from __future__ import annotations

import torch

from pdserve.engine.lora.adapter import LoRAModule


class LoRAStack:
    """One linear layer's slots, part-major so that no part's expand reads another part's zeros:
    A [parts, slots * r, in] and per part Bt [slots * r, that part's output width] (fp32, on the device),
    r = max_lora_rank; slot s's rank rows of a part at [s*r, s*r + its rank)."""

    def __init__(self, slots: int, rank: int, in_features: int, widths: tuple[int, ...],
                 device: torch.device) -> None:
        self.rank = rank
        self.columns = tuple((sum(widths[:p]), w) for p, w in enumerate(widths))  # each part's (offset, width)
        self.a = torch.zeros(len(widths), slots * rank, in_features, device=device)
        self.bt = [torch.zeros(slots * rank, w, device=device) for w in widths]

    def write(self, slot: int, module: LoRAModule | None) -> None:
        """Put one adapter's pairs (None: it does not target this layer) into `slot`, clearing what was there."""
        block = slice(slot * self.rank, (slot + 1) * self.rank)
        self.a[:, block].zero_()
        for bt in self.bt:
            bt[block].zero_()
        offsets = [offset for offset, _ in self.columns]
        for part in module.parts if module is not None else ():
            p, rank = offsets.index(part.offset), part.rank_end - part.rank_start
            self.a[p, block.start:block.start + rank].copy_(module.a[part.rank_start:part.rank_end])
            self.bt[p][block.start:block.start + rank].copy_(part.b.t())


def add_lora_stacked(y: torch.Tensor, x: torch.Tensor, stack: LoRAStack, scale: torch.Tensor) -> None:
    """y += ((x A^T) * scale per row and slot) Bt per part, in fp32, in place; scale: [rows, slots used].

    Only the first `scale.shape[1]` slots take part (the manager fills the lowest free slot first)."""
    n, slots = scale.shape
    width = slots * stack.rank
    t = torch.matmul(x.float(), stack.a[:, :width].transpose(1, 2))  # [parts, n, width]: one bmm
    t.view(-1, n, slots, stack.rank).mul_(scale.view(1, n, slots, 1))
    out = y if y.dtype == torch.float32 else y.float()  # one rounding into y's dtype, as PEFT adds its delta
    for p, (offset, w) in enumerate(stack.columns):
        out[:, offset:offset + w].addmm_(t[p], stack.bt[p][:width])
    if out is not y:
        y.copy_(out)
