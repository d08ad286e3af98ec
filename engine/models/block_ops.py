"""The elementwise steps of a Llama block: the torch reference, and who runs them.

Torch reference (the order and roundings transformers uses, so fp32 logits agree with it to
rounding): residual add + RMSNorm, RoPE, SiLU-and-multiply. On CPU tensors they run through the
compiled kernels of kernels/cpu_block_ops.py instead, which round at the same points (see
kernels/csrc/cpu_block_ops.c for the two places where they may differ in the last bit): in a decode
step these ops are ~25 small torch calls per layer whose cost is dispatch, not arithmetic. Other
devices, other dtypes, shapes the kernels do not take, a machine without the compiled library and
PDSERVE_KERNELS=torch use the reference (common/native_build.py's build_or_none decides the last two).
"""
from __future__ import annotations

import torch

from pdserve.common.native_build import build_or_none


def _make():
    from pdserve.kernels.cpu_block_ops import CpuBlockOps

    return CpuBlockOps()


def _kernels(x: torch.Tensor):
    """The compiled CPU kernels for `x`, or None (one build attempt and at most one warning per process)."""
    if not x.is_cpu:
        return None
    return build_or_none("compiled block ops", _make, "norms, RoPE and SiLU use torch ops")


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x); without a residual, (rms_norm(x), x).

    The compiled path writes the sum into `residual`'s storage: the caller's running residual stream,
    which it passes on and never reads from elsewhere."""
    kernels = _kernels(x)
    if kernels is not None:
        done = kernels.add_rms_norm(x, residual, weight, eps)
        if done is not None:
            return done
    stream = x if residual is None else residual + x
    return rms_norm_ref(stream, weight, eps), stream


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat((x2, x1), dim=-1) * sin[:, None]


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, heads, head_dim] rotated by each row's cos/sin [n, head_dim] (sin carries rotate_half's
    sign: x*cos + cat(x2, x1)*sin equals transformers' x*cos + cat(-x2, x1)*sin)."""
    kernels = _kernels(x)
    if kernels is not None:
        done = kernels.rope(x, cos, sin)
        if done is not None:
            return done
    return rope_ref(x, cos, sin)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, gate_up = [gate | up] along the last dim (the fused gate/up projection)."""
    kernels = _kernels(gate_up)
    if kernels is not None:
        done = kernels.silu_mul(gate_up)
        if done is not None:
            return done
    return silu_mul_ref(gate_up)
