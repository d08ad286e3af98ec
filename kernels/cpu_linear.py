"""Linear layers with bf16 weights through the compiled kernels, for CPUs where oneDNN is not the best.

Two kernels, one calling convention (y = x @ W^T + bias, bf16 in and out, one ctypes call per layer;
the kernel converts x, multiplies, adds the bias and rounds y to bf16 itself):

- `Bf16Linear` (kernels/csrc/cpu_linear_bf16.c): any x86-64 (AVX-512F, AVX2 or plain C). Widens the
  weights to fp32 in registers: the path of CPUs without bf16 instructions, where oneDNN's bf16 GEMM
  is emulated (AVX-512) or absent (AVX2).
- `Bf16DotLinear` (kernels/csrc/cpu_linear_avx512bf16.c): CPUs with AVX512_BF16. Uses the bf16 dot
  instruction.

engine/models/linear.py repacks each weight once at load (`pack`) into the kernel's own layout (see
each source's header) for the paths kernels/linear_choice.py measured fastest on this CPU. `extra_flags` builds a kernel with
other compiler flags (the tests build both with `-march=x86-64-v3`, an AVX2-only CPU's view).
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pdserve.common.native_build import BuildError, load_library
from pdserve.kernels.host_memory import huge_empty

SOURCE = Path(__file__).with_name("csrc") / "cpu_linear_bf16.c"
DOT_SOURCE = Path(__file__).with_name("csrc") / "cpu_linear_avx512bf16.c"
PANEL = 16  # PANEL in both C sources: output columns per weight panel
# Bf16Linear's stored position -> column within one k of a panel: 2j holds column j, 2j+1 column j+8.
_PANEL_ORDER = [c for j in range(PANEL // 2) for c in (j, j + PANEL // 2)]

_c_ptr, _c_int, _c_i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
_ARGTYPES = [_c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_int, _c_int, _c_int, _c_i64, _c_i64, _c_int]


@functools.lru_cache(maxsize=None)
def _library(source: Path, build_dir: Path | None, extra_flags: tuple[str, ...]) -> ctypes.CDLL:
    return load_library(source, build_dir, extra_flags)


def _entry(lib: ctypes.CDLL, name: str):
    fn = getattr(lib, name)
    fn.restype = _c_int
    fn.argtypes = _ARGTYPES
    return fn


@dataclass
class PackedBf16:
    """A bf16 weight [N, K] as one kernel reads it: panels of 16 output columns in that kernel's
    `layout`, and the bias in fp32, zero-padded to whole panels (None without bias)."""
    panels: torch.Tensor
    bias: torch.Tensor | None
    out_features: int
    in_features: int
    layout: str
    # The addresses every call passes (the tensors never move): read once, not per call.
    panels_ptr: int = field(init=False)
    bias_ptr: int | None = field(init=False)

    def __post_init__(self) -> None:
        self.panels_ptr = self.panels.data_ptr()
        self.bias_ptr = None if self.bias is None else self.bias.data_ptr()


def _padded(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """weight [N, K] zero-padded to whole panels; the bias as fp32, padded alike."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = torch.zeros(panels * PANEL, k, dtype=torch.bfloat16)
    padded[:n] = weight.detach()
    b = None
    if bias is not None:
        b = torch.zeros(panels * PANEL, dtype=torch.float32)
        b[:n] = bias.detach().float()
    return padded, b


class _Kernel:
    layout = ""
    k_multiple = 1
    available = True  # whether this build can run on this CPU (see Bf16DotLinear)

    def __init__(self, fn) -> None:
        self._fn = fn

    @classmethod
    def supports(cls, weight: torch.Tensor) -> bool:
        return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
                and weight.shape[1] % cls.k_multiple == 0 and weight.shape[1] > 0 and weight.shape[0] > 0)

    def __call__(self, x: torch.Tensor, weight: PackedBf16) -> torch.Tensor:
        """x [M, K] bf16 (any M; rows may be strided) -> [M, N] bf16. A decode step makes ~50 of these
        calls: the checks below are the cheap ones that keep the C code's assumptions."""
        if not self.available:
            raise BuildError("this build of the bf16 dot kernel has no AVX512_BF16 (check `available`)")
        if x.dtype != torch.bfloat16 or not x.is_cpu or x.dim() != 2:
            raise TypeError(f"bf16 linear kernel takes 2-d bf16 CPU activations, not {x.dtype} {tuple(x.shape)} "
                            f"on {x.device}")
        if weight.layout != self.layout:
            raise ValueError(f"weight packed as {weight.layout!r}, this kernel reads {self.layout!r}")
        if x.stride(1) != 1:
            x = x.contiguous()
        m, k = x.shape
        if k != weight.in_features:
            raise ValueError(f"x has {k} features, the weight {weight.in_features}")
        n = weight.out_features
        y = torch.empty(m, n, dtype=torch.bfloat16)
        if m == 0:
            return y
        rc = self._fn(y.data_ptr(), x.data_ptr(), weight.panels_ptr, weight.bias_ptr, m, n, k, x.stride(0), n,
                      torch.get_num_threads())
        if rc != 0:
            raise MemoryError(f"bf16 linear kernel could not allocate scratch for {m} x {k} activations")
        return y


class Bf16Linear(_Kernel):
    """y = x @ weight^T (+ bias) for bf16 CPU tensors on any x86-64 CPU (AVX2 or not), weights packed
    by `pack`; build once per process."""
    layout = "fp32-widen"
    k_multiple = 8

    def __init__(self, build_dir: Path | None = None, extra_flags: tuple[str, ...] = ()) -> None:
        super().__init__(_entry(_library(SOURCE, build_dir, tuple(extra_flags)), "pd_linear_bf16"))

    @staticmethod
    def pack(weight: torch.Tensor, bias: torch.Tensor | None) -> PackedBf16:
        """The kernel's layout of `weight` (check `supports` first): [ceil(N/16), K, 16], same bytes as the
        weight plus the padding of the last panel."""
        n, k = weight.shape
        padded, b = _padded(weight, bias)
        order = torch.tensor(_PANEL_ORDER)
        packed = _streamed(padded.view(-1, PANEL, k)[:, order, :].transpose(1, 2))
        return PackedBf16(packed, b, n, k, Bf16Linear.layout)


def _streamed(view: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of `view` in huge-page-backed memory: every decode step streams the weights."""
    out = huge_empty(view.shape, view.dtype)
    out.copy_(view)
    return out


class Bf16DotLinear(_Kernel):
    """y = x @ weight^T (+ bias) with the AVX512_BF16 dot instruction, weights packed by `pack`. Built
    anywhere; `available` says whether this build can run it (False on a CPU, or with flags, without
    AVX512_BF16: then calls raise)."""
    layout = "bf16-pairs"
    k_multiple = 2

    def __init__(self, build_dir: Path | None = None, extra_flags: tuple[str, ...] = ()) -> None:
        lib = _library(DOT_SOURCE, build_dir, tuple(extra_flags))
        super().__init__(_entry(lib, "pd_linear_bf16_dot"))
        self.available = bool(lib.pd_linear_bf16_dot_available())

    @staticmethod
    def pack(weight: torch.Tensor, bias: torch.Tensor | None) -> PackedBf16:
        """The kernel's layout of `weight` (check `supports` first): [ceil(N/16), K/2, 16, 2], k pairs of
        16 columns, same bytes as the weight plus the padding of the last panel."""
        n, k = weight.shape
        padded, b = _padded(weight, bias)
        packed = _streamed(padded.view(-1, PANEL, k // 2, 2).permute(0, 2, 1, 3))
        return PackedBf16(packed, b, n, k, Bf16DotLinear.layout)

