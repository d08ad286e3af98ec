"""Large CPU tensors the kernels stream through, backed by transparent huge pages where the OS allows.

A decode step reads every weight and the batch's whole KV cache from memory. With 4 KiB pages
that is a TLB miss every 4 KiB of the stream (the bench model: ~70,000 per step for the weights
alone); 2 MiB pages cut that 512-fold. Linux backs an anonymous range with huge pages only if
asked (madvise MADV_HUGEPAGE) before the range is first touched, when
/sys/kernel/mm/transparent_hugepage/enabled is `madvise` (most distributions' default) or
`always`; with `never` the advice does nothing. Only the 2 MiB-aligned interior of a tensor is
advised (the allocator's alignment is finer), so the pages around it stay as they were.
"""
from __future__ import annotations

import ctypes
import sys

import torch

HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux

_madvise = None
if sys.platform.startswith("linux"):
    _madvise = ctypes.CDLL(None, use_errno=True).madvise
    _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _madvise.restype = ctypes.c_int


def advise_huge_pages(t: torch.Tensor) -> int:
    """Ask for huge pages behind `t`'s untouched CPU memory; the bytes advised (0: too small, not CPU,
    not Linux, or refused: advice only, never an error)."""
    if _madvise is None or t.device.type != "cpu":
        return 0
    start, nbytes = t.data_ptr(), t.untyped_storage().nbytes()
    lo = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    hi = (start + nbytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if hi <= lo or _madvise(lo, hi - lo, _MADV_HUGEPAGE) != 0:
        return 0
    return hi - lo


def huge_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """torch.empty on the CPU, advised for huge pages before anything writes it."""
    t = torch.empty(shape, dtype=dtype)
    advise_huge_pages(t)
    return t
