"""pdserve's C sources (kernels/csrc/, kvstore/csrc/) as shared libraries, and the one rule for when
there is none.

Why C through ctypes rather than a torch C++ extension: a plain C file with no torch headers compiles
in about a second, so a machine builds it at its first engine start from the sources installed as
package data, and the wheel stays one pure-Python file for every machine kind.

Where `load_library` finds a library, in order:
1. the build cache (common/paths.py `kernels_dir()`), keyed by the source and every file it
   includes, the compiler and its version, the flags and the CPU's feature flags (builds use
   -march=native, or the level of a PDSERVE_CPU_ISA / ONEDNN_MAX_CPU_ISA cap: common/cpu_isa.py), so
   a changed source, another machine kind or another cap gets a build of its own;
2. a build now with $CC, else cc or gcc. Racing processes each build into a temp file and rename it
   into place: readers never see half a library;
3. a library prebuilt at install (`python -m pdserve.common.native_build --prebuild`, what the
   container image's build stage runs; `prebuilt_kernels_dir()`) for the widest x86-64 level of
   TARGETS this CPU runs (under the cap): an image has no compiler, and its builder's CPU may not be
   its host's.
Anything else (a missing source, no compiler and nothing prebuilt, a failed build, a library the
loader refuses) is a BuildError, and `build_or_none` is the one rule for it: one warning per reason,
and the caller runs its torch (or Python) path. It also keeps every compiled path off when the
process asked for another backend (PDSERVE_KERNELS=torch, common/kernel_choice.py).

A source carries its own recipe: the files it includes with `#include "name"` (found beside it) are
part of its key, and a `PD_CFLAGS: <flags>` line in it adds flags after FLAGS.

OpenMP: libraries are linked with -fopenmp, and at run time the dynamic loader resolves libgomp.so.1
to the copy torch already loaded, so a kernel shares torch's thread pool instead of starting another.
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pdserve.common import cpu_isa
from pdserve.common.kernel_choice import compiled_enabled
from pdserve.common.paths import kernels_dir, prebuilt_kernels_dir

logger = logging.getLogger(__name__)

FLAGS = ("-O3", "-fopenmp", "-fPIC", "-shared", "-std=gnu11",
         # Lets the compiler vectorize float sums (reassociation); no fast-math beyond that.
         "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math")
ROOT = Path(__file__).resolve().parent.parent  # the installed pdserve package, or the checkout
_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)
_CFLAGS = re.compile(r"PD_CFLAGS:([^\n]*)")
_COMPILE_TIMEOUT_S = 300


class BuildError(RuntimeError):
    """No library for this source here: the caller falls back to its torch or Python path."""


@dataclass(frozen=True)
class Target:
    """An x86-64 level libraries are prebuilt for: its flags, and the /proc/cpuinfo flags it needs."""

    name: str
    flags: tuple[str, ...]
    needs: frozenset[str]


_V3, _V4 = cpu_isa.V3, cpu_isa.V4
# Widest first. The sources choose their vector paths at compile time (AVX2, AVX-512, AVX512_BF16),
# so each level a CPU kind may stop at is a build of its own.
TARGETS: tuple[Target, ...] = (
    Target("x86-64-v4-bf16", ("-march=x86-64-v4", "-mavx512bf16"), _V4 | {"avx512_bf16"}),
    Target("x86-64-v4", ("-march=x86-64-v4",), _V4),
    Target("x86-64-v3", ("-march=x86-64-v3",), _V3),
    Target("x86-64", ("-march=x86-64",), frozenset()),
) if platform.machine() == "x86_64" else ()


@dataclass(frozen=True)
class Recipe:
    """A source as it builds: its text and its includes' (the key), and its own PD_CFLAGS."""

    source: Path
    texts: tuple[str, ...]
    flags: tuple[str, ...]


def recipe(source: Path) -> Recipe:
    texts, seen, todo = [], set(), [Path(source)]
    while todo:
        path = todo.pop(0)
        if path in seen:
            continue
        seen.add(path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise BuildError(f"source {path} is missing ({exc.strerror or exc})") from None
        texts.append(text)
        todo += [path.parent / name for name in _INCLUDE.findall(text)]
    flags = tuple(flag for line in _CFLAGS.findall(texts[0]) for flag in line.replace("*/", " ").split())
    return Recipe(Path(source), tuple(texts), flags)


def sources(root: Path = ROOT) -> list[Path]:
    """Every library's source: the .c files of the packages' csrc/ folders."""
    return sorted(root.glob("*/csrc/*.c"))


T = TypeVar("T")
_lock = threading.RLock()
_built: dict[str, Any] = {}  # build_or_none's answers, by name
_warned: set[str] = set()  # reasons already given as a warning
_loaded: dict[str, str] = {}  # source stem -> where its library came from, and its path


def build_or_none(name: str, make: Callable[[], T], fallback: str) -> T | None:
    """`make()` (a wrapper that loads its library), once per process per `name`, or None: when the process
    asked for another backend (PDSERVE_KERNELS=torch|triton: no build, no log), or when `make` raises
    BuildError (log_fallback: `fallback` says what runs instead)."""
    if not compiled_enabled():
        return None
    if name in _built:  # the hot path (a decode step asks ~50 times): no lock
        return _built[name]
    with _lock:
        if name not in _built:
            try:
                _built[name] = make()
            except BuildError as exc:
                log_fallback(name, exc, fallback)
                _built[name] = None
        return _built[name]


def log_fallback(what: str, exc: Exception, fallback: str) -> None:
    """`what` unavailable, why, and what runs instead: a warning the first time a reason is given in this
    process (no compiler fails every library the same way), an info line after that."""
    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    with _lock:
        level = logging.INFO if reason in _warned else logging.WARNING
        _warned.add(reason)
    logger.log(level, "%s unavailable (%s); %s", what, reason, fallback)


def loaded_libraries() -> dict[str, str]:
    """{source stem: "<how>: <path>"} of the libraries this process loaded; how: a cached build, built
    now, or prebuilt for a level."""
    with _lock:
        return dict(_loaded)


def load_library(source: Path, build_dir: Path | None = None, extra_flags: tuple[str, ...] = (),
                 prebuilt_dir: Path | None = None) -> ctypes.CDLL:
    """The library of `source` (the module docstring says where it comes from), else BuildError.
    `build_dir`: the build cache (default kernels_dir()); `extra_flags` follow all others (tests build a
    lower ISA level with e.g. -march=x86-64-v3); `prebuilt_dir`: default prebuilt_kernels_dir()."""
    r = recipe(source)
    build_dir = kernels_dir() if build_dir is None else build_dir
    flags = _build_flags(r, extra_flags)
    try:
        cc, version = _compiler()
        path = build_dir / f"{r.source.stem}-{_key(*r.texts, version, *flags, _cpu_identity())}.so"
        how = "cached build"
        if not path.exists():
            started = time.perf_counter()
            _compile(cc, r.source, flags, path)
            how = f"built from {r.source} with {cc} in {time.perf_counter() - started:.1f} s"
    except BuildError as exc:
        found = _find_prebuilt(r, extra_flags, prebuilt_kernels_dir() if prebuilt_dir is None else prebuilt_dir)
        if found is None:
            raise BuildError(f"{exc}; and no library prebuilt for this CPU") from None
        path, how = found
    return _open(r.source.stem, path, how)


def _build_flags(r: Recipe, extra_flags: tuple[str, ...]) -> tuple[str, ...]:
    return (*FLAGS, *cpu_isa.march_flags(), *r.flags, *extra_flags)


def build_flags(source: Path, extra_flags: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The compiler flags `load_library(source, extra_flags=extra_flags)` builds with here."""
    return _build_flags(recipe(source), tuple(extra_flags))


def target_macros(flags: tuple[str, ...]) -> frozenset[str]:
    """The macros the compiler predefines under `flags` (__AVX2__, __AVX512F__, __AVX512BF16__, ...): the
    instruction sets a build with them targets, which is what the sources' `#if`s pick their vector paths
    by. Tests use it to check that a build is the level they name. BuildError without a compiler."""
    cc, _ = _compiler()
    try:
        proc = subprocess.run([cc, *flags, "-dM", "-E", "-x", "c", os.devnull], capture_output=True, text=True,
                              timeout=_COMPILE_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as exc:
        raise BuildError(f"{cc} -dM -E failed: {exc}") from None
    if proc.returncode != 0:
        raise BuildError(f"{cc} -dM -E failed: {proc.stderr.strip()[-2000:]}")
    return frozenset(line.split()[1] for line in proc.stdout.splitlines() if line.startswith("#define "))


def _key(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _prebuilt_path(r: Recipe, target: Target, extra_flags: tuple[str, ...], directory: Path) -> Path:
    flags = (*FLAGS, *target.flags, *r.flags, *extra_flags)
    return directory / f"{r.source.stem}-{target.name}-{_key(*r.texts, *flags)}.so"


def runnable_targets() -> tuple[Target, ...]:
    """The levels of TARGETS this CPU runs (those the cap leaves), widest first."""
    cpu = cpu_isa.effective_flags()
    return tuple(target for target in TARGETS if target.needs <= cpu)


def _find_prebuilt(r: Recipe, extra_flags: tuple[str, ...], directory: Path) -> tuple[Path, str] | None:
    for target in runnable_targets():
        path = _prebuilt_path(r, target, extra_flags, directory)
        if path.exists():
            return path, f"prebuilt for {target.name}"
    return None


def _open(stem: str, path: Path, how: str) -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise BuildError(f"{path} does not load: {exc}") from None
    entry = f"{how}: {path}"
    with _lock:
        first, _loaded[stem] = _loaded.get(stem) != entry, entry
    if first:
        logger.info("compiled %s: %s", stem, entry)
    return lib


def _cpu_flags_line() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _cpu_identity() -> str:
    return f"{platform.machine()}|{_cpu_flags_line().strip()}"


def _compiler() -> tuple[str, str]:
    """(the compiler, its --version text), or BuildError."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise BuildError("no C compiler found (set CC or install gcc)")
    try:
        proc = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        raise BuildError(f"compiler {cc} does not run: {exc}") from None
    if proc.returncode != 0:
        raise BuildError(f"compiler {cc} does not run: --version exited {proc.returncode}")
    return cc, proc.stdout


def _compile(cc: str, source: Path, flags: tuple[str, ...], target: Path) -> None:
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}-", dir=target.parent)
        os.close(fd)
        proc = subprocess.run([cc, *flags, "-o", tmp, str(source), "-lm"], capture_output=True, text=True,
                              timeout=_COMPILE_TIMEOUT_S)
        if proc.returncode != 0:
            raise BuildError(f"{cc} failed on {source.name}: {proc.stderr.strip()[-2000:]}")
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would keep a prebuilt library from an image's unprivileged user
        os.replace(tmp, target)
    except (OSError, subprocess.SubprocessError) as exc:
        raise BuildError(f"{cc} failed on {source.name}: {exc}") from None
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def prebuild(dest: Path | None = None, only: list[Path] | None = None, targets: tuple[Target, ...] = TARGETS,
             jobs: int | None = None) -> list[Path]:
    """Build every source (or those in `only`) for each target into `dest` (default prebuilt_kernels_dir());
    BuildError without a compiler or when a build fails."""
    cc, _ = _compiler()
    dest = prebuilt_kernels_dir() if dest is None else dest
    work = [(recipe(source), target) for source in (sources() if only is None else only) for target in targets]

    def one(item: tuple[Recipe, Target]) -> Path:
        r, target = item
        path = _prebuilt_path(r, target, (), dest)
        _compile(cc, r.source, (*FLAGS, *target.flags, *r.flags), path)
        return path

    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        return list(pool.map(one, work))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.common.native_build",
                                     description="Prebuild pdserve's C libraries, or say where each one loads from "
                                                 "here (exit status 1 if any has none).")
    parser.add_argument("--prebuild", action="store_true",
                        help=f"build every source for {', '.join(t.name for t in TARGETS) or 'no target'} "
                             f"into --dest (needs a C compiler)")
    parser.add_argument("--dest", type=Path, default=None, help=f"default {prebuilt_kernels_dir()}")
    parser.add_argument("--target", action="append", choices=[t.name for t in TARGETS], default=None,
                        help="only this level (repeatable; default all)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.prebuild:
        try:
            chosen = tuple(t for t in TARGETS if args.target is None or t.name in args.target)
            paths = prebuild(args.dest, targets=chosen)
        except BuildError as exc:
            print(f"prebuild failed: {exc}", file=sys.stderr)
            return 1
        print(f"{len(paths)} libraries in {args.dest or prebuilt_kernels_dir()}")
        return 0
    try:  # the libraries take OpenMP from the libgomp.so.1 torch ships (an image has no other): load it first
        import torch  # noqa: F401
    except ImportError:
        pass
    missing = 0
    for source in sources():
        try:
            load_library(source)
        except BuildError as exc:
            missing += 1
            print(f"{source.stem}: unavailable ({str(exc).splitlines()[0]})")
    for stem, entry in loaded_libraries().items():
        print(f"{stem}: {entry}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
