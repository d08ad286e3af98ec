"""Build a small C source into a shared library at first use, cached per machine kind.

Why C through ctypes rather than a torch C++ extension: a plain C file with no torch headers
compiles in about a second, so a fresh machine (CI included) builds it inside its first
engine start, and no build step or wheel is needed. The library is cached under the given
directory, keyed by the source, the compiler, the flags and the CPU's feature flags (it is
built with -march=native), so a changed source or a different machine kind gets its own build.
Racing processes each build into a temp file and rename it into place: readers never see half a
library.

OpenMP: the library is linked with -fopenmp, and at run time the dynamic loader resolves
libgomp.so.1 to the copy torch already loaded, so the kernel shares torch's thread pool
instead of starting a second one on the same cores.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

logger = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11",
         # Lets the compiler vectorize float sums (reassociation); no fast-math beyond that.
         "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math")


class BuildError(RuntimeError):
    """No compiler, or the compiler failed: the caller falls back to the torch reference."""


T = TypeVar("T")


def build_or_none(make: Callable[[], T], what: str, fallback: str) -> T | None:
    """`make()` (a kernel wrapper that builds its library), or None with one warning saying what is
    used instead. Callers cache the answer, so a process tries one build and warns at most once."""
    try:
        return make()
    except BuildError as exc:
        logger.warning("%s unavailable (%s); %s", what, str(exc).splitlines()[0], fallback)
        return None


def _cpu_identity() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return f"{platform.machine()}|{flags.strip()}"


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise BuildError("no C compiler found (set CC or install gcc)")
    return cc


def load_library(source: Path, build_dir: Path, extra_flags: tuple[str, ...] = (),
                 depends: tuple[Path, ...] = ()) -> ctypes.CDLL:
    """The compiled library of `source` (built now if this machine kind has no cached build).
    `extra_flags` follow FLAGS (tests build a lower ISA level with e.g. -mno-avx512f); `depends`:
    files `source` includes, part of the cache key like the source."""
    cc = _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise BuildError(f"compiler {cc} does not run: {exc}") from None
    flags = (*FLAGS, *extra_flags)
    texts = [source.read_text(), *(d.read_text() for d in depends)]
    key = hashlib.sha256("\0".join([*texts, version, *flags, _cpu_identity()]).encode()).hexdigest()
    target = build_dir / f"{source.stem}-{key[:16]}.so"
    if not target.exists():
        build_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}-", dir=build_dir)
        os.close(fd)
        try:
            proc = subprocess.run([cc, *flags, "-o", tmp, str(source), "-lm"], capture_output=True, text=True,
                                  timeout=300)
            if proc.returncode != 0:
                raise BuildError(f"{cc} failed on {source.name}: {proc.stderr.strip()[-2000:]}")
            os.replace(tmp, target)
            logger.info("built %s with %s (%s)", target, cc, " ".join(flags))
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return ctypes.CDLL(str(target))
