"""Linear layer whose CPU weights are pre-packed once for oneDNN.

`F.linear` on CPU re-lays-out (packs) the weight matrix on every call; for the small batches of
decode steps that repacking costs about as much as the product itself. Packing once at load time
(what torch's own CPU compiler does for frozen weights) roughly halves decode matmul time for
bfloat16 and more for float32. Anything else (other devices, dtypes, builds without oneDNN) uses
plain `F.linear`.

bfloat16 on a CPU without bf16 matmul instructions (oneDNN's packed bf16 path needs avx512bw/vl/dq
or avx_ne_convert; an AVX2-only CPU refuses it): batches of more than SMALL_BATCH rows use a
float32 packed copy of the weights, the result rounded back to bfloat16 (what a bf16 GEMM does
anyway: bf16 products are exact in fp32, sums accumulate in fp32), several times faster there
than torch's emulated bf16 GEMM. Batches of a few rows (low-concurrency decode) are bound by
reading the weights, so they go to a small compiled kernel (kernels/cpu_linear.py) that reads the
bf16 weights themselves, half the bytes of the fp32 copy (at 16 rows the two are even). Both
layouts are kept: 3x the bf16 weight memory on such CPUs.
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

_PACKABLE = (torch.float32, torch.bfloat16)
SMALL_BATCH = 4  # rows up to which the bf16 kernel clearly beats the fp32 packed GEMM (bench model, AVX2)


@functools.lru_cache(maxsize=1)
def _small_batch_kernel():
    """The bf16 small-batch kernel, or None when it cannot be built here (no C compiler): one build
    attempt and at most one warning per process."""
    from engine.builtin_model import cache_dir
    from kernels.cpu_build import BuildError
    from kernels.cpu_linear import Bf16Linear

    try:
        return Bf16Linear(cache_dir() / "kernels")
    except BuildError as exc:
        logger.warning("bf16 small-batch linear kernel unavailable (%s); decode uses the fp32 copy",
                       str(exc).splitlines()[0])
        return None


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.packed: torch.Tensor | None = None
        self.packed_bias: torch.Tensor | None = None  # the bias in the packed path's dtype
        self.compute_dtype: torch.dtype | None = None  # float32 when bf16 weights are packed as fp32
        self.small_batch = None  # the bf16 small-batch kernel, on CPUs without bf16 instructions

    def pack(self) -> None:
        """Call once the weights are loaded. The plain weight is then dropped (a tied embedding keeps
        its own reference) unless the small-batch kernel reads it: holding both layouts costs memory."""
        w = self.weight
        if w.device.type != "cpu" or w.dtype not in _PACKABLE or not torch.backends.mkldnn.is_available():
            return
        self.packed_bias = None if self.bias is None else self.bias.detach()
        try:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 16)
        except RuntimeError:  # no bf16 instructions on this CPU: pack an fp32 copy, compute in fp32
            self.compute_dtype = torch.float32
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach().float(), 16)
            if self.bias is not None:
                self.packed_bias = self.bias.detach().float()
            from kernels.cpu_linear import Bf16Linear

            if Bf16Linear.supports(w.detach()):
                self.small_batch = _small_batch_kernel()
        if self.small_batch is None:
            self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        if self.compute_dtype is None:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.packed_bias, "none", [], "")
        if self.small_batch is not None and x.dim() == 2 and x.shape[0] <= SMALL_BATCH and x.dtype == torch.bfloat16:
            return self.small_batch(x, self.weight, self.bias)
        y = torch.ops.mkldnn._linear_pointwise(x.to(self.compute_dtype).contiguous(), self.packed, self.packed_bias,
                                               "none", [], "")
        return y.to(x.dtype)
