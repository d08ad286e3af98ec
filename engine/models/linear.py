"""Linear layer whose CPU weights are pre-packed once at load, for the paths this CPU runs fastest.

`F.linear` on CPU re-lays-out (packs) the weight matrix on every call; for the small batches of
decode steps that repacking costs about as much as the product itself. Packing once at load time
(what torch's own CPU compiler does for frozen weights) roughly halves decode matmul time. fp32
weights are packed for oneDNN's fp32 GEMM. Other devices, dtypes and builds without oneDNN use plain
`F.linear`.

bf16 weights on CPU: which path (kernels/linear_paths.py: oneDNN's bf16 GEMM, oneDNN's fp32 GEMM on
an fp32 copy, the compiled fp32-widening kernel, the AVX512_BF16 dot kernel) serves a call depends on
what the CPU can do, so it is measured once at start-up and cached per CPU (kernels/linear_choice.py,
one log line), separately for decode-sized calls (fewer than LARGE_FROM rows) and prefill-sized ones.
A layer packs for the first path of each ranking that takes its shape; where the two kinds choose
differently it keeps both layouts (the choice only does that for a clear gain). PDSERVE_KERNELS=torch
and PDSERVE_LINEAR override the measurement. Every path gives fp32 sums of the exact bf16 products
rounded to bf16; they differ in summation order only.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels.linear_choice import LARGE_FROM, linear_choice
from pdserve.kernels.linear_paths import PATHS, LinearPath


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.packed: torch.Tensor | None = None  # fp32 weights in oneDNN's layout
        self.packed_bias: torch.Tensor | None = None
        self.small: LinearPath | None = None  # bf16: the path of decode-sized calls, and its packed state
        self.small_state = None
        self.large: LinearPath | None = None  # bf16: the path of prefill-sized calls (maybe the same)
        self.large_state = None

    def pack(self) -> None:
        """Call once the weights are loaded. The plain weight is then dropped (a tied embedding keeps
        its own reference)."""
        w = self.weight
        if w.device.type != "cpu" or not torch.backends.mkldnn.is_available():
            return
        if w.dtype == torch.float32:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 16)
            self.packed_bias = None if self.bias is None else self.bias.detach()
        elif w.dtype == torch.bfloat16 and self._pack_bf16():
            pass
        else:
            return
        self.weight = None

    def _pack_bf16(self) -> bool:
        """Pack for the chosen path of each kind of call; False (plain F.linear) when none takes the shape."""
        choice = linear_choice()
        w = self.weight.detach()
        small = next((PATHS[p] for p in choice.small if PATHS[p].supports(w)), None)
        large = next((PATHS[p] for p in choice.large if PATHS[p].supports(w)), None)
        if small is None or large is None:
            return False
        self.small, self.small_state = small, small.pack(w, self.bias)
        self.large = large
        self.large_state = self.small_state if large is small else large.pack(w, self.bias)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.small is not None:
            x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # the model's flattened batch: no reshaping
            if x2.shape[0] < LARGE_FROM:
                y = self.small.run(self.small_state, x2)
            else:
                y = self.large.run(self.large_state, x2)
            return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.packed_bias, "none", [], "")
