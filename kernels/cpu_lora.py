"""Multi-LoRA on decode rows through the compiled kernel (kernels/csrc/cpu_lora.c): one ctypes call per layer.

`LoRAWeights` holds one linear layer's slots in the kernel's layout (fp32, as PEFT keeps adapter weights),
written when a slot gets another adapter; `LoRAKernel` adds each row's adapter delta into y in place, shrink
and expand in one call, rounded once into y's dtype. engine/lora/stacked.py takes this path on CPU when the
library builds (`build_or_none`: else its torch path runs). `extra_flags` builds another ISA level (tests).
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from pdserve.common.native_build import load_library

SOURCE = Path(__file__).with_name("csrc") / "cpu_lora.c"
PANEL = 16  # PANEL in the C source: output columns per Bt panel

_c_ptr, _c_int, _c_i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
_ARGTYPES = [_c_ptr, _c_int, _c_i64, _c_ptr, _c_int, _c_i64, _c_int, _c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_ptr,
             _c_int, _c_int, _c_ptr, _c_int, _c_int, _c_int]
_DTYPES = (torch.bfloat16, torch.float32)


@functools.lru_cache(maxsize=None)
def _library(build_dir: Path | None, extra_flags: tuple[str, ...]) -> ctypes.CDLL:
    return load_library(SOURCE, build_dir, extra_flags)


class LoRAWeights:
    """One linear layer's slots as the kernel reads them (see the C source's header): A [slots, parts * r, in],
    Bt [slots, panels, r, 16] (each part's output columns in panels of 16, the last zero-padded) and each
    slot's rank per part (0: nothing there; the kernel skips it)."""

    def __init__(self, slots: int, rank: int, in_features: int, widths: tuple[int, ...]) -> None:
        self.slots, self.rank, self.in_features = slots, rank, in_features
        self.widths = torch.tensor(widths, dtype=torch.int32)
        self.out_features = sum(widths)
        panels = [-(-w // PANEL) for w in widths]
        self.first_panel = [sum(panels[:p]) for p in range(len(widths))]
        self.a = torch.zeros(slots, len(widths) * rank, in_features)
        self.bt = torch.zeros(slots, sum(panels), rank, PANEL)
        self.ranks = torch.zeros(slots, len(widths), dtype=torch.int32)

    def clear(self, slot: int) -> None:
        self.ranks[slot].zero_()  # the kernel reads no rank row beyond these: the old weights may stay

    def put(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Part `part` of `slot`: a [rank, in] (its rows of A), b [width, rank] (its B)."""
        rank, width = a.shape[0], int(self.widths[part])
        if rank > self.rank or b.shape != (width, rank) or a.shape[1] != self.in_features:
            raise ValueError(f"part {part}: A {tuple(a.shape)}, B {tuple(b.shape)} do not fit rank {self.rank}, "
                             f"in {self.in_features}, width {width}")
        self.a[slot, part * self.rank:part * self.rank + rank].copy_(a)
        panels = -(-width // PANEL)
        padded = torch.zeros(panels * PANEL, rank)
        padded[:width] = b
        block = self.bt[slot, self.first_panel[part]:self.first_panel[part] + panels]
        block.zero_()
        block[:, :rank].copy_(padded.view(panels, PANEL, rank).transpose(1, 2))
        self.ranks[slot, part] = rank


class LoRAKernel:
    """y += each row's adapter delta (its slot: -1 for the base model's rows; its scaling) for bf16 or fp32
    CPU tensors; build once per process (BuildError without a library)."""

    def __init__(self, build_dir: Path | None = None, extra_flags: tuple[str, ...] = ()) -> None:
        fn = _library(build_dir, tuple(extra_flags)).pd_lora_apply
        fn.restype = _c_int
        fn.argtypes = _ARGTYPES
        self._fn = fn

    def __call__(self, y: torch.Tensor, x: torch.Tensor, row_slot: torch.Tensor, row_scale: torch.Tensor,
                 weights: LoRAWeights) -> None:
        """In place on y [rows, out]; x [rows, in]; row_slot int32 [rows]; row_scale fp32 [rows]. About 120
        calls a decode step: only the checks that keep the C code's assumptions."""
        rows = x.shape[0]
        if (x.dtype not in _DTYPES or y.dtype not in _DTYPES or not x.is_cpu or not y.is_cpu
                or x.dim() != 2 or y.dim() != 2):
            raise TypeError(f"LoRA kernel takes 2-d bf16/fp32 CPU tensors, not x {x.dtype} {tuple(x.shape)} on "
                            f"{x.device}, y {y.dtype} {tuple(y.shape)} on {y.device}")
        if (x.shape[1] != weights.in_features or y.shape != (rows, weights.out_features)
                or row_slot.shape != (rows,) or row_scale.shape != (rows,)):
            raise ValueError(f"LoRA kernel: x {tuple(x.shape)}, y {tuple(y.shape)}, {tuple(row_slot.shape)} slots, "
                             f"{tuple(row_scale.shape)} scalings for in {weights.in_features}, "
                             f"out {weights.out_features}")
        if (row_slot.dtype != torch.int32 or row_scale.dtype != torch.float32 or not row_slot.is_contiguous()
                or not row_scale.is_contiguous()):
            raise TypeError("LoRA kernel: row_slot must be contiguous int32 and row_scale contiguous fp32")
        if x.stride(1) != 1:
            x = x.contiguous()
        if y.stride(1) != 1:
            raise ValueError("LoRA kernel: y's columns must be contiguous (it writes y in place)")
        rc = self._fn(y.data_ptr(), y.dtype == torch.float32, y.stride(0), x.data_ptr(), x.dtype == torch.float32,
                      x.stride(0), rows, row_slot.data_ptr(), row_scale.data_ptr(), weights.a.data_ptr(),
                      weights.bt.data_ptr(), weights.ranks.data_ptr(), weights.slots, len(weights.widths),
                      weights.widths.data_ptr(), weights.rank, weights.in_features, torch.get_num_threads())
        if rc != 0:
            raise MemoryError(f"LoRA kernel could not allocate scratch for {rows} rows")
