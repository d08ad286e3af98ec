"""Which kernels a process asked for: PDSERVE_KERNELS=auto|triton|torch, or `use_backend` in-process.

`auto` (the default) lets each piece pick its fastest path: Triton on CUDA, the compiled C code on
CPU (the kernels, the KV store's native readers). `torch` forces the torch/Python reference paths
everywhere, compiled C included; `triton` forces Triton (its interpreter on CPU, for tests). This
lives below every package because the KV store's native readers obey it as much as the kernels do.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from pdserve.common import env

ENV = env.KERNELS.name
BACKENDS = ("auto", "triton", "torch")
_forced: list[str] = []


@contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Force a backend for the calls made inside the block (any thread), then restore."""
    _check(name, "use_backend")
    _forced.append(name)
    try:
        yield
    finally:
        _forced.pop()


def _check(name: str, source: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{source}: unknown kernel backend {name!r}; expected one of {', '.join(BACKENDS)}")
    return name


def requested_backend() -> str:
    """The forced choice (use_backend, else PDSERVE_KERNELS), or 'auto'."""
    return _forced[-1] if _forced else _check(env.value(env.KERNELS), ENV)


def compiled_enabled() -> bool:
    """Whether compiled C paths may run: only under `auto` (a forced backend means its reference)."""
    return requested_backend() == "auto"
