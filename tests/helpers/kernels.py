"""Shared helpers of the kernel tests: call counting, and the instruction-set levels the compiled CPU
kernels are built and tested at.

Each level is a build of its own (the sources pick their vector paths at compile time), made with the
flags of the x86-64 level the image prebuilds for it (common/native_build.py TARGETS). A case at a level
the CPU (or the PDSERVE_CPU_ISA cap) lacks skips with a reason naming the missing flag
(tests/plugins/isa_report.py `lacks`), and a case that runs checks that its build is that level, so no build
passes under a level it is not.
"""
from __future__ import annotations

import functools
import platform
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pdserve.common import cpu_isa
from pdserve.common.native_build import TARGETS, build_flags, target_macros
from tests.plugins.isa_report import MARKER, lacks

X86 = platform.machine() in ("x86_64", "AMD64")


@dataclass(frozen=True)
class Level:
    """One instruction-set level: `flags` build a library at it (they follow the build's own -march, and a later
    -march wins), `needs` are the /proc/cpuinfo flags a CPU must show to run that build, the flag that names
    the level first (it is the one a skip reason names)."""

    name: str
    flags: tuple[str, ...]
    needs: tuple[str, ...]


def _needs(first: str, flags: frozenset[str]) -> tuple[str, ...]:
    return (first, *sorted(flags - {first}))


_FLAGS = {target.name: target.flags for target in TARGETS}  # empty off x86-64: only `c` builds there, as it is
LEVELS: dict[str, Level] = {
    "c": Level("c", _FLAGS.get("x86-64", ()), ()),
    "avx2": Level("avx2", _FLAGS.get("x86-64-v3", ()), _needs("avx2", cpu_isa.V3)),
    "avx512": Level("avx512", _FLAGS.get("x86-64-v4", ()), _needs("avx512f", cpu_isa.V4)),
    "avx512_bf16": Level("avx512_bf16", _FLAGS.get("x86-64-v4-bf16", ()),
                         _needs("avx512_bf16", cpu_isa.V4 | {"avx512_bf16"})),
    # No pdserve source has an AMX path: oneDNN's bf16 GEMM (the onednn_bf16 linear path) takes one.
    "amx": Level("amx", (), ("amx_tile", "amx_bf16")),
}
# The compiler's macros that make a build each level (the sources' own `#if`s test subsets of these).
_V4_MACROS = frozenset({"__AVX512F__", "__AVX512BW__", "__AVX512CD__", "__AVX512DQ__", "__AVX512VL__"})
_LEVEL_MACROS = {"avx512_bf16": _V4_MACROS | {"__AVX512BF16__"}, "avx512": _V4_MACROS,
                 "avx2": frozenset({"__AVX2__", "__FMA__", "__F16C__"})}


def runs(name: str) -> bool:
    """Whether this CPU, under the cap, runs builds at level `name`."""
    return all(cpu_isa.has(flag) for flag in LEVELS[name].needs)


def require(name: str) -> Level:
    """The level, or a skip saying which flag this CPU (under the cap) lacks for it."""
    level = LEVELS[name]
    missing = next((flag for flag in level.needs if not cpu_isa.has(flag)), None)
    if missing is not None:
        pytest.skip(lacks(name, missing))
    return level


def level_param(name: str, value: Any = None, id: str | None = None) -> Any:
    """A parameter (`value`, default the level's name; id default the name) marked as a case at level `name`."""
    return pytest.param(name if value is None else value, id=id or name, marks=getattr(pytest.mark, MARKER)(name))


def level_params(*names: str) -> list[Any]:
    """Parameters for the levels `names`, each its level's name, id and marker."""
    return [level_param(name) for name in names]


def built_level(source: Path, extra_flags: tuple[str, ...]) -> str:
    """The level a build of `source` with `extra_flags` targets, read from the compiler's macros under the
    build's own flags: the widest level whose macros they all define, else c."""
    macros = _macros(build_flags(source, tuple(extra_flags)))
    return next((name for name, needed in _LEVEL_MACROS.items() if needed <= macros), "c")


@functools.lru_cache(maxsize=None)
def _macros(flags: tuple[str, ...]) -> frozenset[str]:
    return target_macros(flags)


def count_calls(targets: list[tuple[Any, str]], patch: Callable[[Any, str, Any], None] = setattr) -> dict[str, int]:
    """Wrap each module.name so its calls are counted (the real function still runs).

    Pass `monkeypatch.setattr` as `patch` to have the wrappers removed after a test.
    """
    calls: dict[str, int] = {}
    for module, name in targets:
        def counted(*args, _real=getattr(module, name), _name=name, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _real(*args, **kwargs)
        patch(module, name, counted)
    return calls
