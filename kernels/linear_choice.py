"""Which linear path (kernels/linear_paths.py) bf16 layers take, per kind of call, chosen by measuring.

Two kinds of call: decode-sized batches (fewer than LARGE_FROM rows: the weights stream from memory,
bytes decide) and prefill-sized ones (compute decides). At the first bf16 layer's pack the engine
times every available path on one core and one weight shape at SMALL_ROWS and LARGE_ROWS rows (about
a second, bounded by BUDGET_S); `choose` turns those GFLOP/s into the ranking of each kind. The
result is cached as JSON under the kernels cache, keyed by the CPU's model name and flags, the caps,
torch's version and the kernels' sources, so a restart reads it instead of measuring; one log line says the CPU, the
chosen paths and their GFLOP/s. Deleting the file measures again.

Who wins over the measurement: PDSERVE_KERNELS=torch keeps the reference choice (oneDNN's packed bf16,
or its fp32 GEMM on an fp32 copy where oneDNN cannot pack bf16), unmeasured; `PDSERVE_LINEAR=PATH`
or `PDSERVE_LINEAR=SMALL,LARGE` names the paths (an unknown or unavailable one is a start-up error).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field

import torch

from pdserve.common import cpu_isa, env
from pdserve.common.kernel_choice import compiled_enabled
from pdserve.common.native_build import BuildError, recipe
from pdserve.common.paths import kernels_dir
from pdserve.kernels import linear_paths

logger = logging.getLogger(__name__)

ENV = env.LINEAR.name
LARGE_FROM = 64  # rows from which a call counts as prefill-sized
SMALL_ROWS, LARGE_ROWS = 16, 256  # the rows each kind is measured at
SHAPE = (2048, 1024)  # N x K of the measured weight: a 7B-class model's projections are larger, a 135M's smaller
# A second weight layout costs its bytes again: only worth it where the prefill-sized path beats the
# decode-sized one's own prefill figure by this much.
MIN_GAIN = 0.15
BUDGET_S = 0.05  # timing per path and kind, after one warm-up pass
DEADLINE_S = 0.6  # per kind of call: a machine too busy to finish the passes in time stops after the second
# A measurement whose thread was on a core for less of its wall time than this (others took it) is used
# by this process but not cached: the next start measures again.
MIN_CORE_SHARE = 0.9
VERSION = 1  # of the measurement protocol and the cache file: bump when either changes
KINDS = ("small", "large")


@dataclass(frozen=True)
class LinearChoice:
    """Paths ranked per kind of call, best first (a layer takes the first one that supports its shape),
    the GFLOP/s behind them ({kind: {path: GFLOP/s}}, empty when not measured) and where they came from."""

    small: tuple[str, ...]
    large: tuple[str, ...]
    gflops: dict[str, dict[str, float]] = field(default_factory=dict)
    source: str = "measured"

    def ranking(self, rows: int) -> tuple[str, ...]:
        return self.small if rows < LARGE_FROM else self.large


def choose(gflops: dict[str, dict[str, float]], source: str = "measured") -> LinearChoice:
    """The ranking per kind from measured GFLOP/s ({"small": {path: GFLOP/s}, "large": {...}}): fastest
    first, except that the decode-sized winner also leads the prefill ranking unless the prefill-sized
    winner beats it there by MIN_GAIN (one layout instead of two)."""
    small = tuple(sorted(gflops["small"], key=lambda p: -gflops["small"][p]))
    large = list(sorted(gflops["large"], key=lambda p: -gflops["large"][p]))
    if small and large and large[0] != small[0] and small[0] in large:
        if gflops["large"][large[0]] < (1 + MIN_GAIN) * gflops["large"][small[0]]:
            large.remove(small[0])
            large.insert(0, small[0])
    return LinearChoice(small, tuple(large), gflops, source)


def measure(paths: tuple[str, ...], budget_s: float = BUDGET_S) -> tuple[dict[str, dict[str, float]], float]:
    """GFLOP/s of each path on one core at SMALL_ROWS and LARGE_ROWS rows on SHAPE: its fastest call over
    about `budget_s` of calls per path and kind. Passes are interleaved (each path in turn) and the
    fastest call counts, so a moment when other processes take the cores costs one call, not a path.
    Decode-sized passes cycle over copies of the weight larger together than the last-level cache, as a
    decode step's layers do; prefill-sized ones are compute-bound and use two.

    One core, because the ranking is what a short measurement can give reliably: with every thread, one
    core taken by another process stalls each parallel call at its barrier, and a neighbour's load would
    decide the choice (seen on a shared 2-core machine: the prefill-sized figures fell 2-6x and swapped
    their order, while the one-core figures stayed within 10%). Returns ({kind: {path: GFLOP/s}}, the
    share of the timed wall time the measuring thread was on a core): below MIN_CORE_SHARE other
    processes took the core often enough to distort the figures.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure(paths, budget_s)
    finally:
        torch.set_num_threads(threads)


def _measure(paths: tuple[str, ...], budget_s: float) -> tuple[dict[str, dict[str, float]], float]:
    n, k = SHAPE
    g = torch.Generator().manual_seed(0)
    copies = max(2, min(12, -(-5 * _llc_bytes() // (4 * n * k * 2))))
    weights = [(torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16) for _ in range(copies)]
    states = {name: [linear_paths.PATHS[name].pack(w, None) for w in weights] for name in paths}
    out: dict[str, dict[str, float]] = {kind: {} for kind in KINDS}
    cpu = wall = 0.0
    for kind, rows, used in (("small", SMALL_ROWS, copies), ("large", LARGE_ROWS, 2)):
        x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
        best = {name: float("inf") for name in paths}
        spent, deadline = 0.0, time.perf_counter() + DEADLINE_S
        for rep in range(1000):
            for name in paths:
                run = linear_paths.PATHS[name].run
                for state in states[name][:used]:
                    t0, c0 = time.perf_counter(), time.thread_time()
                    run(state, x)
                    dt = time.perf_counter() - t0
                    if rep > 0:  # the first pass pays first-call costs (oneDNN primitives, page faults)
                        best[name] = min(best[name], dt)
                        spent, cpu = spent + dt, cpu + time.thread_time() - c0
            if rep >= 3 and spent >= budget_s * len(paths) or rep >= 1 and time.perf_counter() > deadline:
                break
        for name in paths:
            out[kind][name] = 2.0 * rows * n * k / best[name] / 1e9
        wall += spent
    return out, cpu / wall


def _llc_bytes() -> int:
    """The last-level cache's size (sysfs), or 32 MiB where it cannot be read."""
    best = 0
    for index in range(8):
        try:
            with open(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size") as f:
                text = f.read().strip()
        except OSError:
            break
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        best = max(best, int(text.rstrip("KMG") or 0) * scale)
    return best or 32 << 20


def _override(paths: tuple[str, ...]) -> LinearChoice | None:
    value = env.value(env.LINEAR).strip()
    if not value or value == "auto":
        return None
    names = [v.strip() for v in value.split(",")]
    if len(names) not in (1, 2) or any(v not in linear_paths.PATHS for v in names):
        raise ValueError(f"{ENV}={value!r}: expected auto, PATH or SMALL,LARGE with paths from "
                         f"{', '.join(linear_paths.PATHS)}")
    missing = [v for v in names if v not in paths]
    if missing:
        raise ValueError(f"{ENV}={value!r}: {', '.join(missing)} cannot run here (available: {', '.join(paths)})")
    small, large = names[0], names[-1]
    rest = tuple(p for p in paths if p not in names)
    return LinearChoice((small, *rest), (large, *rest), {}, f"{ENV}={value}")


def _cache_path(paths: tuple[str, ...]) -> str:
    """Keyed by everything that moves the figures: the CPU, the caps, torch (oneDNN), the compiled kernels'
    sources, the candidates and the protocol."""
    from pdserve.kernels import cpu_linear

    sources = []
    for source in (cpu_linear.SOURCE, cpu_linear.DOT_SOURCE):
        try:
            sources += recipe(source).texts
        except BuildError:
            sources.append("missing")
    key = "|".join([cpu_isa.model_name(), " ".join(sorted(cpu_isa.cpu_flags())), str(cpu_isa.cap()),
                    os.environ.get(cpu_isa.ONEDNN_ENV, ""), os.environ.get("MKL_ENABLE_INSTRUCTIONS", ""),
                    torch.__version__, ",".join(paths), str(VERSION), *sources])
    return str(kernels_dir() / f"linear-choice-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json")


def _read_cache(path: str, paths: tuple[str, ...]) -> dict[str, dict[str, float]] | None:
    """The cached GFLOP/s if the file is there and well-formed (JSON only: never code from a file)."""
    try:
        with open(path) as f:
            data = json.load(f)
        gflops = {kind: {p: float(data["gflops"][kind][p]) for p in paths} for kind in KINDS}
        return gflops if data.get("version") == VERSION else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_cache(path: str, gflops: dict[str, dict[str, float]], seconds: float) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"version": VERSION, "cpu": cpu_isa.describe(), "threads": 1,
                       "shape": list(SHAPE), "rows": {"small": SMALL_ROWS, "large": LARGE_ROWS},
                       "measured_s": round(seconds, 3), "gflops": gflops}, f, indent=1)
        os.replace(tmp, path)
    except OSError as exc:  # a read-only cache costs a measurement per start, nothing else
        logger.warning("linear path choice not cached (%s): the next start measures again", exc)


_lock = threading.Lock()
_chosen: dict[tuple, LinearChoice] = {}


def linear_choice() -> LinearChoice:
    """This process's choice for bf16 layers (made once per set of conditions, logged once)."""
    state = (compiled_enabled(), env.value(env.LINEAR), cpu_isa.cap())
    if state in _chosen:
        return _chosen[state]
    with _lock:
        if state not in _chosen:
            _chosen[state] = _decide()
        return _chosen[state]


def _decide() -> LinearChoice:
    paths = linear_paths.available()
    if not paths:
        return LinearChoice((), (), {}, "no oneDNN")
    choice = _override(paths)
    if choice is None and not compiled_enabled():
        ref = tuple(p for p in linear_paths.TORCH_PATHS if p in paths)
        choice = LinearChoice(ref, ref, {}, "PDSERVE_KERNELS=torch")
    if choice is None:
        cache = _cache_path(paths)
        gflops = _read_cache(cache, paths)
        source = f"cached in {cache}"
        if gflops is None:
            started = time.perf_counter()
            gflops, share = measure(paths)
            seconds = time.perf_counter() - started
            if share >= MIN_CORE_SHARE:
                _write_cache(cache, gflops, seconds)
                source = f"measured in {seconds:.2f} s, cached in {cache}"
            else:
                source = (f"measured in {seconds:.2f} s while other processes took {1 - share:.0%} of the core: "
                          f"not cached, the next start measures again")
        choice = choose(gflops, source)
    logger.info("linear layers (bf16): CPU %s: %s; %s", cpu_isa.describe(), describe(choice), choice.source)
    return choice


def describe(choice: LinearChoice) -> str:
    """'rows<64 bf16_widen 168 GFLOP/s (onednn_fp32 112, ...), rows>=64 ...' (names only when unmeasured)."""
    parts = []
    for kind, label in (("small", f"rows<{LARGE_FROM}"), ("large", f"rows>={LARGE_FROM}")):
        ranked, numbers = getattr(choice, kind), choice.gflops.get(kind, {})
        if not ranked:
            continue
        if not numbers:
            parts.append(f"{label} {ranked[0]}")
            continue
        others = ", ".join(f"{p} {numbers[p]:.0f}" for p in ranked[1:])
        parts.append(f"{label} {ranked[0]} {numbers[ranked[0]]:.0f} GFLOP/s per core"
                     + (f" ({others})" if others else ""))
    return ", ".join(parts) or "no path"
