"""Linear layer whose CPU weights are pre-packed once for oneDNN.

`F.linear` on CPU re-lays-out (packs) the weight matrix on every call; for the small batches of
decode steps that repacking costs about as much as the product itself. Packing once at load time
(what torch's own CPU compiler does for frozen weights) roughly halves decode matmul time for
bfloat16 and more for float32. Anything else (other devices, dtypes, builds without oneDNN) uses
plain `F.linear`.
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

    def pack(self) -> None:
        """Call once the weights are loaded. The plain weight is then dropped (a tied embedding keeps
        its own reference): holding both layouts would double the model's memory."""
        w = self.weight
        if w.device.type == "cpu" and w.dtype in _PACKABLE and torch.backends.mkldnn.is_available():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 16)
            self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
