"""Multi-LoRA on decode rows through the compiled kernel (kernels/csrc/cpu_lora.c): one ctypes call per layer.

`LoRAWeights` holds one linear layer's slots in the kernel's layout (fp32, as PEFT keeps adapter weights, or
bf16: `--lora-dtype`, engine/lora/dtype.py), written when a slot gets another adapter; `LoRAKernel` adds each row's adapter delta into y in place, shrink
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
_ARGTYPES = [_c_ptr, _c_int, _c_i64, _c_ptr, _c_int, _c_i64, _c_int, _c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_int,
             _c_ptr, _c_int, _c_int, _c_ptr, _c_int, _c_int, _c_int]
_DTYPES = (torch.bfloat16, torch.float32)


@functools.lru_cache(maxsize=None)
def _library(build_dir: Path | None, extra_flags: tuple[str, ...]) -> ctypes.CDLL:
    return load_library(SOURCE, build_dir, extra_flags)


class LoRAWeights:
    """One linear layer's slots as the kernel reads them (see the C source's header): A [slots, parts * r, in],
    Bt [slots, panels, r, 16] (each part's output columns in panels of 16, the last zero-padded) and each
    slot's rank per part (0: nothing there; the kernel skips it). `dtype`: fp32 or bf16 (what put() is given is
    rounded to it)."""

    def __init__(self, slots: int, rank: int, in_features: int, widths: tuple[int, ...],
                 dtype: torch.dtype = torch.float32) -> None:
        if dtype not in _DTYPES:
            raise ValueError(f"LoRA kernel weights are bf16 or fp32, not {dtype}")
        self.slots, self.rank, self.in_features = slots, rank, in_features
        self.widths = torch.tensor(widths, dtype=torch.int32)
        self.out_features = sum(widths)
        panels = [-(-w // PANEL) for w in widths]
        self.first_panel = [sum(panels[:p]) for p in range(len(widths))]
        self.a = torch.zeros(slots, len(widths) * rank, in_features, dtype=dtype)
        self.bt = torch.zeros(slots, sum(panels), rank, PANEL, dtype=dtype)
        self.ranks = torch.zeros(slots, len(widths), dtype=torch.int32)
        # What every call passes after the rows (the tensors are written in place, never moved): read once.
        self.args = (self.a.data_ptr(), self.bt.data_ptr(), dtype == torch.bfloat16, self.ranks.data_ptr(), slots,
                     len(widths), self.widths.data_ptr(), rank, in_features)

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
        padded = torch.zeros(panels * PANEL, rank, dtype=self.bt.dtype)
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
        """In place on y [rows, out]; x [rows, in]; row_slot int32 [rows]; row_scale fp32 [rows]. A decode step
        makes ~120 calls, and checks on torch attributes cost twice the ctypes call itself: only the ones that
        keep the C code's assumptions, in one expression."""
        xs, ys = x.shape, y.shape
        if not (x.dtype in _DTYPES and y.dtype in _DTYPES and x.device.type == "cpu" and y.device.type == "cpu"
                and len(xs) == 2 and xs[1] == weights.in_features and ys == (xs[0], weights.out_features)
                and row_slot.dtype == torch.int32 and row_scale.dtype == torch.float32
                and row_slot.shape == row_scale.shape == xs[:1] and row_slot.is_contiguous()
                and row_scale.is_contiguous() and y.stride(1) == 1):
            raise ValueError(f"LoRA kernel: x {x.dtype} {tuple(xs)} on {x.device}, y {y.dtype} {tuple(ys)} on "
                             f"{y.device} (columns contiguous), row_slot {row_slot.dtype} {tuple(row_slot.shape)}, "
                             f"row_scale {row_scale.dtype} {tuple(row_scale.shape)} do not fit in "
                             f"{weights.in_features}, out {weights.out_features} (bf16/fp32 CPU tensors, contiguous "
                             f"int32 slots and fp32 scalings)")
        if x.stride(1) != 1:
            x = x.contiguous()
        rc = self._fn(y.data_ptr(), y.dtype == torch.float32, y.stride(0), x.data_ptr(), x.dtype == torch.float32,
                      x.stride(0), xs[0], row_slot.data_ptr(), row_scale.data_ptr(), *weights.args,
                      torch.get_num_threads())
        if rc != 0:
            raise MemoryError(f"LoRA kernel could not allocate scratch for {xs[0]} rows")
