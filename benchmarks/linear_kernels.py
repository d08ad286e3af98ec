"""GFLOP/s of the engine's compiled bf16 linear kernel vs the oneDNN path it replaces, per weight
shape and batch rows, and for a whole decode step's linear layers.

Which pair is compared depends on the CPU, as engine/models/linear.py's choice does:
- AVX512_BF16 (with or without AMX): oneDNN's packed bf16 GEMM vs the bf16 dot kernel
  (`Bf16DotLinear`); the engine takes the kernel for every batch on CPUs without AMX (one weight
  layout). This table is what that choice rests on.
- no bf16 instructions (AVX2-only): oneDNN's fp32 GEMM on an fp32 copy of the weights vs the
  fp32-widening bf16 kernel (`Bf16Linear`), which the engine takes for every batch there.

Shapes default to the bench preset's layers (qkv, o_proj, gate_up, down). Both paths run in the
same process, interleaved (one timing of each in turn, best of `--repeats` timings of `--iters`
calls each), so a busy moment hits both. Each call takes the next of several copies of the weight,
together larger than the last-level cache, as a decode step does. The step table then runs
`--layers` layers of the four bench shapes (12: the bench model, 48 calls; weights far larger than
the cache) per batch size, as the decode step's linear layers do.

    python benchmarks/linear_kernels.py [--rows 1 4 16 64 256] [--threads 2] [--layers 12]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from pdserve.kernels.cpu_linear import Bf16DotLinear, Bf16Linear

from machine import describe

BENCH_SHAPES = ["2048x1024", "1024x1024", "5632x1024", "1024x2816"]  # N x K: qkv, o_proj, gate_up, down


def _onednn_packs_bf16() -> bool:
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 16)
        return True
    except RuntimeError:
        return False


class Paths:
    """The baseline (oneDNN) and the kernel of this CPU, each with its own weight layout."""

    def __init__(self, build_dir: Path) -> None:
        self.native = _onednn_packs_bf16()
        dot = Bf16DotLinear(build_dir)
        self.kernel = dot if dot.available else Bf16Linear(build_dir)
        self.names = ("oneDNN bf16 packed" if self.native else "oneDNN fp32 packed",
                      "bf16 dot kernel" if dot.available else "bf16 fp32-widen kernel")

    def pack(self, weight: torch.Tensor) -> tuple[torch.Tensor, object]:
        base = weight if self.native else weight.float()
        return torch.ops.mkldnn._reorder_linear_weight(base, 16), type(self.kernel).pack(weight, None)

    def baseline(self, x: torch.Tensor, packed: torch.Tensor) -> None:
        if self.native:
            torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        else:
            torch.ops.mkldnn._linear_pointwise(x.float(), packed, None, "none", [], "").to(torch.bfloat16)

    def ours(self, x: torch.Tensor, panels: object) -> None:
        self.kernel(x, panels)


def _interleaved_best(fns, iters: int, repeats: int) -> list[float]:
    """Best seconds per call of each function, timed in turn `repeats` times."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            best[i] = min(best[i], (time.perf_counter() - start) / iters)
    return best


def per_shape(paths: Paths, args, g: torch.Generator) -> None:
    print(f"| N x K | rows | {paths.names[0]} GFLOP/s | {paths.names[1]} GFLOP/s | kernel/oneDNN |")
    print("|---|---|---|---|---|")
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split("x"))
        weight = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
        copies = max(1, -(-(args.weight_mib << 20) // weight.nbytes))
        packed = [paths.pack(weight) for _ in range(copies)]
        turn = [0]
        for rows in args.rows:
            x = torch.randn(rows, k, generator=g).to(torch.bfloat16)

            def call(which: int):
                def fn():
                    turn[0] = (turn[0] + 1) % copies
                    (paths.baseline if which == 0 else paths.ours)(x, packed[turn[0]][which])
                return fn

            t_base, t_ours = _interleaved_best([call(0), call(1)], args.iters, args.repeats)
            flops = 2.0 * rows * n * k
            print(f"| {n}x{k} | {rows} | {flops / t_base / 1e9:.1f} | {flops / t_ours / 1e9:.1f} "
                  f"| {t_base / t_ours:.2f}x |", flush=True)


def decode_step(paths: Paths, args, g: torch.Generator) -> None:
    shapes = [tuple(int(v) for v in s.split("x")) for s in BENCH_SHAPES]
    layers = [[paths.pack((torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)) for n, k in shapes]
              for _ in range(args.layers)]
    nbytes = 2 * args.layers * sum(n * k for n, k in shapes)
    print(f"\n{args.layers} layers of the bench shapes ({4 * args.layers} calls, {nbytes / 1e6:.0f} MB of bf16 "
          f"weights), best of {args.repeats}, interleaved:")
    print(f"| rows | {paths.names[0]} ms | GFLOP/s | {paths.names[1]} ms | GFLOP/s | kernel/oneDNN |")
    print("|---|---|---|---|---|---|")
    for rows in args.rows:
        xs = {k: torch.randn(rows, k, generator=g).to(torch.bfloat16) for k in {k for _, k in shapes}}

        def step(which: int):
            def fn():
                run = paths.baseline if which == 0 else paths.ours
                for layer in layers:
                    for (_, k), pair in zip(shapes, layer):
                        run(xs[k], pair[which])
            return fn

        t_base, t_ours = _interleaved_best([step(0), step(1)], 1, args.repeats)
        flops = 2.0 * rows * nbytes / 2
        print(f"| {rows} | {t_base * 1e3:.2f} | {flops / t_base / 1e9:.0f} | {t_ours * 1e3:.2f} "
              f"| {flops / t_ours / 1e9:.0f} | {t_base / t_ours:.2f}x |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 128, 256])
    ap.add_argument("--shapes", nargs="*", default=BENCH_SHAPES,
                    help="N x K of each weight (none: only the step table)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--weight-mib", type=int, default=96,
                    help="bf16 MiB of weight copies cycled through per shape (well over the last-level cache)")
    ap.add_argument("--layers", type=int, default=12, help="layers in the decode-step table (0: none)")
    ap.add_argument("--threads", type=int, default=None, help="torch (and kernel) threads; default torch's")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(describe())
    print(f"torch threads: {torch.get_num_threads()}")
    paths = Paths(Path(tempfile.mkdtemp(prefix="pd-linear-bench-")))
    g = torch.Generator().manual_seed(0)
    if args.shapes:
        per_shape(paths, args, g)
    if args.layers:
        decode_step(paths, args, g)


if __name__ == "__main__":
    main()
