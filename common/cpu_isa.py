"""What this CPU can do, and the cap a process puts on it to stand in for a smaller CPU kind.

The CPU kinds pdserve meets differ in their vector instructions (AVX2 only; AVX-512 without bf16, the
Skylake-to-Ice-Lake Xeons most clouds rent; AVX-512 with AVX512_BF16, Zen 4 and Cooper Lake; AMX).
`PDSERVE_CPU_ISA=x86-64|avx2|avx512|avx512_bf16` caps what pdserve's compiled kernels may use, the way
oneDNN's own `ONEDNN_MAX_CPU_ISA` caps oneDNN: the C sources are then built for that level
(`march_flags`, common/native_build.py) instead of `-march=native`, and the choices made from the CPU's
flags (`has`) see only what the cap leaves. Unset, the cap follows `ONEDNN_MAX_CPU_ISA` (AVX2 ->
avx2, AVX512_CORE / AVX512_CORE_VNNI -> avx512, AVX512_CORE_BF16 -> avx512_bf16), so one variable
emulates a kind for both; `native` (or AMX and wider oneDNN caps) means no cap. A cap above what the
CPU has changes nothing. What a cap does not reach: torch's own MKL (fp32 F.linear without a packed
weight) follows `MKL_ENABLE_INSTRUCTIONS`, and the CPU's memory, caches and cores stay this machine's.
"""
from __future__ import annotations

import functools
import os
import platform

from pdserve.common import env

ENV = env.CPU_ISA.name
ONEDNN_ENV = "ONEDNN_MAX_CPU_ISA"
LEVELS = ("x86-64", "avx2", "avx512", "avx512_bf16")  # narrowest first
_MARCH = {"x86-64": ("-march=x86-64",), "avx2": ("-march=x86-64-v3",), "avx512": ("-march=x86-64-v4",),
          "avx512_bf16": ("-march=x86-64-v4", "-mavx512bf16")}
# The /proc/cpuinfo flags of the x86-64-v3 and -v4 levels (what -march=x86-64-v3/-v4 may emit).
V3 = frozenset("avx avx2 bmi1 bmi2 f16c fma abm movbe xsave".split())
V4 = V3 | frozenset("avx512f avx512bw avx512cd avx512dq avx512vl".split())
_ONEDNN_LEVEL = {"SSE41": "x86-64", "AVX": "x86-64", "AVX2": "avx2", "AVX2_VNNI": "avx2", "AVX2_VNNI_2": "avx2",
                 "AVX512_CORE": "avx512", "AVX512_CORE_VNNI": "avx512", "AVX512_CORE_BF16": "avx512_bf16",
                 "AVX512_CORE_FP16": "avx512_bf16"}
# The flags worth a log line: what decides a kernel's path.
SHOWN = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> tuple[str, frozenset[str]]:
    model, flags = "", frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not model:
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = frozenset(value.split())
                    break
    except OSError:
        pass
    return model, flags


def model_name() -> str:
    """lscpu's "Model name" (the /proc/cpuinfo line it reads)."""
    return _cpuinfo()[0] or platform.processor() or platform.machine()


def cpu_flags() -> frozenset[str]:
    """The CPU's own feature flags (/proc/cpuinfo), before any cap."""
    return _cpuinfo()[1]


def native_level(flags: frozenset[str] | None = None) -> str:
    """The widest of LEVELS the flags hold."""
    flags = cpu_flags() if flags is None else flags
    if V4 <= flags:
        return "avx512_bf16" if "avx512_bf16" in flags else "avx512"
    return "avx2" if V3 <= flags else "x86-64"


def cap() -> str | None:
    """The level the process caps kernels at ($PDSERVE_CPU_ISA, else from $ONEDNN_MAX_CPU_ISA), or None.
    ValueError for a PDSERVE_CPU_ISA that is not a level: a typo must not measure the wrong kind."""
    value = env.value(env.CPU_ISA).strip().lower()
    if value in ("", "native"):
        return None if value else _ONEDNN_LEVEL.get(os.environ.get(ONEDNN_ENV, "").strip().upper())
    if value not in LEVELS:
        raise ValueError(f"{ENV}={value!r} is not one of native, {', '.join(LEVELS)}")
    return value


def level() -> str:
    """The level kernels run at here: the CPU's own, or the cap where that is narrower."""
    native, capped = native_level(), cap()
    return capped if capped is not None and LEVELS.index(capped) < LEVELS.index(native) else native


def hidden_by(lvl: str, flags: frozenset[str]) -> frozenset[str]:
    """The flags a CPU capped at `lvl` does not show."""
    hide = {f for f in flags if f.startswith("amx") or f == "avx512_fp16"}
    if LEVELS.index(lvl) < LEVELS.index("avx512_bf16"):
        hide.add("avx512_bf16")
    if LEVELS.index(lvl) < LEVELS.index("avx512"):
        hide |= {f for f in flags if f.startswith("avx512") or f == "avx_vnni"}
    if lvl == "x86-64":
        hide |= {f for f in flags if f.startswith("avx")} | (V3 & flags)
    return frozenset(hide & flags)


def effective_flags() -> frozenset[str]:
    """The CPU's flags as the cap leaves them (all of them without a cap)."""
    flags, capped = cpu_flags(), cap()
    return flags if capped is None else flags - hidden_by(capped, flags)


def has(flag: str) -> bool:
    """Whether kernels may use `flag` (a /proc/cpuinfo name, e.g. avx512_bf16, amx_tile) here."""
    return flag in effective_flags()


def march_flags() -> tuple[str, ...]:
    """The compiler's target for pdserve's C sources: -march=native, or the cap's level tuned for this CPU."""
    if cap() is None or platform.machine() != "x86_64" or level() == native_level():
        return ("-march=native",)
    return (*_MARCH[level()], "-mtune=native")


def describe() -> str:
    """One log fragment: the model name, the flags that decide kernels, and the cap if any."""
    shown = " ".join(f for f in SHOWN if has(f)) or "no AVX2"
    capped = cap()
    where = ENV if env.value(env.CPU_ISA).strip() else ONEDNN_ENV
    return f"{model_name()!r} [{shown}{f'; capped at {capped} by {where}' if capped else ''}]"
