"""Linear layer whose CPU weights are pre-packed once at load.

`F.linear` on CPU re-lays-out (packs) the weight matrix on every call; for the small batches of
decode steps that repacking costs about as much as the product itself. Packing once at load time
(what torch's own CPU compiler does for frozen weights) roughly halves decode matmul time for
bfloat16 and more for float32. Anything else (other devices, dtypes, builds without oneDNN) uses
plain `F.linear`. The choice for bfloat16 weights, per CPU:

- AMX (Sapphire Rapids and later), or AVX-512 without AVX512_BF16: oneDNN's packed bf16 GEMM, every
  batch size.
- AVX512_BF16 without AMX (Zen 4, Cooper Lake): the compiled bf16 dot kernel (kernels/cpu_linear.py,
  `Bf16DotLinear`) for every batch size. It keeps the dot instruction busy while the weights stream
  from memory (`benchmarks/linear_kernels.py` on a 2-core Zen 4, the bench model's 48 calls:
  1.2-1.5x oneDNN's packed bf16 at 1 and 16 rows, 1.1x at 4, 1.05x at 64, even at 128-256 rows,
  0.97x at 512). One layout only: keeping oneDNN's as well for prefill batches would double the
  weights' memory to win those 3% back. Both round y to bf16 from fp32 sums of exact bf16 products
  (in different orders), and both flush denormals (the same dot instruction, which ignores MXCSR).
- No bf16 instructions (AVX2-only; oneDNN's packed bf16 path needs avx512bw/vl/dq or avx_ne_convert,
  so it refuses): the weights are repacked once into the panels of the compiled bf16 kernel
  (kernels/cpu_linear.py, `Bf16Linear`), which widens them to fp32 in registers and accumulates in
  fp32 (what a bf16 GEMM does: bf16 products are exact in fp32), the result rounded to bf16. It beats
  oneDNN's fp32 GEMM on an fp32 copy of the weights at every batch size measured (1 to 1024 rows, the
  bench model's shapes) and reads half the bytes, so no fp32 copy is kept. Where the kernel cannot be
  built (no C compiler) or cannot take the shape, an fp32 packed copy is the fallback.

PDSERVE_KERNELS=torch (or a machine without the compiled library) keeps both kernels out: the layer
then packs for oneDNN as above, or an fp32 copy where oneDNN cannot pack bf16. The choice is made once,
in `pack`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.common.native_build import build_or_none

_PACKABLE = (torch.float32, torch.bfloat16)


def _dot_kernel():
    """The bf16 dot kernel where it is chosen (AVX512_BF16 without AMX) and available, else None: one
    build attempt and at most one warning per process (build_or_none)."""
    if not (torch.cpu._is_avx512_bf16_supported() and not torch.cpu._is_amx_tile_supported()):
        return None
    from pdserve.kernels.cpu_linear import Bf16DotLinear

    kernel = build_or_none("bf16 dot kernel", Bf16DotLinear, "bf16 layers use oneDNN's packed bf16")
    return kernel if kernel is not None and kernel.available else None


def _bf16_kernel():
    """The bf16 linear kernel, or None where it is not available (build_or_none)."""
    from pdserve.kernels.cpu_linear import Bf16Linear

    return build_or_none("bf16 linear kernel", Bf16Linear, "bf16 layers use an fp32 packed copy")


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.packed: torch.Tensor | None = None  # oneDNN's layout (bf16 natively, or an fp32 copy)
        self.packed_bias: torch.Tensor | None = None  # the bias in the oneDNN path's dtype
        self.compute_dtype: torch.dtype | None = None  # float32 when bf16 weights are packed as fp32
        self.bf16_kernel = None  # the compiled bf16 kernel, on CPUs without bf16 instructions
        self.bf16_panels = None  # the weights in that kernel's layout (kernels.cpu_linear.PackedBf16)
        self.dot_kernel = None  # the bf16 dot kernel, on AVX512_BF16 CPUs without AMX
        self.dot_panels = None  # the weights in its layout (kernels.cpu_linear.PackedBf16)

    def pack(self) -> None:
        """Call once the weights are loaded. The plain weight is then dropped (a tied embedding keeps
        its own reference): holding two layouts costs memory."""
        w = self.weight
        if w.device.type != "cpu" or w.dtype not in _PACKABLE or not torch.backends.mkldnn.is_available():
            return
        if w.dtype == torch.bfloat16 and self._pack_dot():
            self.weight = None
            return
        self.packed_bias = None if self.bias is None else self.bias.detach()
        try:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 16)
        except RuntimeError:  # no bf16 instructions on this CPU
            from pdserve.kernels.cpu_linear import Bf16Linear

            kernel = _bf16_kernel() if Bf16Linear.supports(w.detach()) else None
            if kernel is not None:
                self.bf16_kernel = kernel
                self.bf16_panels = Bf16Linear.pack(w.detach(), None if self.bias is None else self.bias.detach())
            else:  # pack an fp32 copy, compute in fp32
                self.compute_dtype = torch.float32
                self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach().float(), 16)
                if self.bias is not None:
                    self.packed_bias = self.bias.detach().float()
        self.weight = None

    def _pack_dot(self) -> bool:
        """Whether the bf16 dot kernel takes this layer (its layout then replaces the weight)."""
        from pdserve.kernels.cpu_linear import Bf16DotLinear

        kernel = _dot_kernel() if Bf16DotLinear.supports(self.weight.detach()) else None
        if kernel is None:
            return False
        self.dot_kernel = kernel
        self.dot_panels = Bf16DotLinear.pack(self.weight.detach(), None if self.bias is None else self.bias.detach())
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dot_panels is not None:
            if x.dim() == 2:  # the model's flattened batch: no reshaping
                return self.dot_kernel(x, self.dot_panels)
            y = self.dot_kernel(x.reshape(-1, x.shape[-1]), self.dot_panels)
            return y.view(*x.shape[:-1], y.shape[-1])
        if self.bf16_panels is not None:
            y = self.bf16_kernel(x.reshape(-1, x.shape[-1]), self.bf16_panels)
            return y.view(*x.shape[:-1], y.shape[-1])
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        if self.compute_dtype is None:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.packed_bias, "none", [], "")
        y = torch.ops.mkldnn._linear_pointwise(x.to(self.compute_dtype).contiguous(), self.packed, self.packed_bias,
                                               "none", [], "")
        return y.to(x.dtype)
