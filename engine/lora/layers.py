"""LoRALinear: a base linear layer plus, for each adapter's rows of the step, `(x A^T) B^T * scaling`.

The step's rows are grouped by adapter (LoRAStep, set by the manager before each forward), as vLLM's
punica kernels take a per-row adapter index: each group's rows are gathered, multiplied by that
adapter's A and B, and added back to its output columns; the base model's rows get nothing. The
product and the add run in fp32, rounded once to the layer's dtype, as PEFT computes them.

The last layer runs its MLP on the sampled rows only (docs/architecture.md, "Last-layer rows"), so a
layer tells the two groupings apart by its input's row count.

Steps with few rows (decode) take the batched path instead (stacked.py: every slot stacked per layer, one
compiled call on CPU, a few torch ops elsewhere, whatever the adapter count): the manager then sets each
row's slot and scaling rather than groups.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from pdserve.engine.lora.adapter import LoRAModule
from pdserve.engine.lora.stacked import LoRAStack, RowSlots, add_lora_stacked

# (the adapter's modules on this device, its scaling, the rows: None for all of them)
Group = tuple[dict[tuple[int, str], LoRAModule], float, torch.Tensor | None]


@dataclass
class LoRAStep:
    """One step's row groups, or for the batched path each row's slot and scaling (None: the groups' path):
    over every token row, and over the sampled rows (the last layer's MLP)."""

    num_tokens: int = 0
    rows: list[Group] = field(default_factory=list)
    sampled: list[Group] = field(default_factory=list)
    row_slots: RowSlots | None = None
    sampled_slots: RowSlots | None = None

    def groups(self, num_rows: int) -> list[Group]:
        return self.rows if num_rows == self.num_tokens else self.sampled

    def slots(self, num_rows: int) -> RowSlots | None:
        return self.row_slots if num_rows == self.num_tokens else self.sampled_slots


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, layer_idx: int, name: str, step: LoRAStep) -> None:
        super().__init__()
        self.base = base
        self.key = (layer_idx, name)
        self.step = step  # shared by every wrapped layer; the manager refills it each step
        self.stack: LoRAStack | None = None  # the slots' stacked pairs (the manager writes them)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        slots = self.step.slots(x.shape[0])
        if slots is not None and self.stack is not None:
            add_lora_stacked(y, x, self.stack, slots)
            return y
        for modules, scaling, rows in self.step.groups(x.shape[0]):
            module = modules.get(self.key)
            if module is not None:
                add_lora(y, x, module, scaling, rows)
        return y


def add_lora(y: torch.Tensor, x: torch.Tensor, module: LoRAModule, scaling: float,
             rows: torch.Tensor | None) -> None:
    """y[rows, part] += (x[rows] A_part^T) B_part^T * scaling for each part, in fp32, in place.

    The group's rows of y are read and written once (not once per part): each element is still
    y + delta rounded once, PEFT's arithmetic bit for bit."""
    xs = (x if rows is None else x.index_select(0, rows)).float()
    ys = (y if rows is None else y.index_select(0, rows)).float()
    t = xs @ module.a.t()
    for p in module.parts:
        delta = (t[:, p.rank_start:p.rank_end] @ p.b.t()).mul_(scaling)
        ys[:, p.offset:p.offset + p.rows].add_(delta)
    if rows is None:
        y.copy_(ys)
    else:
        y.index_copy_(0, rows, ys.to(y.dtype))
