"""Linear layer whose CPU weights are pre-packed once for oneDNN.

`F.linear` on CPU re-lays-out (packs) the weight matrix on every call; for the small batches of
decode steps that repacking costs about as much as the product itself. Packing once at load time
(what torch's own CPU compiler does for frozen weights) roughly halves decode matmul time for
bfloat16 and more for float32. Anything else (other devices, dtypes, builds without oneDNN) uses
plain `F.linear`.

bfloat16 on a CPU without bf16 matmul instructions (oneDNN's packed bf16 path needs avx512bw/vl/dq
or avx_ne_convert; an AVX2-only CPU refuses it) is packed as float32 instead and computed in
float32, the result rounded back to bfloat16. That is what a bf16 GEMM does anyway (bf16 products
are exact in fp32, sums accumulate in fp32), and on such CPUs it is several times faster than
torch's emulated bf16 GEMM, for twice the weight memory.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_PACKABLE = (torch.float32, torch.bfloat16)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.packed: torch.Tensor | None = None
        self.compute_dtype: torch.dtype | None = None  # float32 when bf16 weights are packed as fp32

    def pack(self) -> None:
        """Call once the weights are loaded. The plain weight is then dropped (a tied embedding keeps
        its own reference): holding both layouts would double the model's memory."""
        w = self.weight
        if w.device.type == "cpu" and w.dtype in _PACKABLE and torch.backends.mkldnn.is_available():
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 16)
            except RuntimeError:  # no bf16 instructions on this CPU: pack and compute in fp32
                self.compute_dtype = torch.float32
                self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach().float(), 16)
                if self.bias is not None:
                    self.bias = nn.Parameter(self.bias.float(), requires_grad=False)
            self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        if self.compute_dtype is None:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        y = torch.ops.mkldnn._linear_pointwise(x.to(self.compute_dtype).contiguous(), self.packed, self.bias,
                                               "none", [], "")
        return y.to(x.dtype)
