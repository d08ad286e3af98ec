"""GFLOP/s of the bf16 linear kernel vs oneDNN's fp32 packed GEMM, per weight shape and batch rows.

On CPUs where oneDNN cannot pack bf16 weights (AVX2-only) engine/models/linear.py runs bf16
layers through the kernel of kernels/cpu_linear.py instead of oneDNN on an fp32 copy of the
weights; this table is what that choice rests on. Shapes default
to the bench preset's layers (qkv, o_proj, gate_up, down); both paths run in the same process,
alternating, best of `--repeats` timings of `--iters` calls each. Each call takes the next of
several copies of the weight, together larger than the last-level cache, as a decode step does
(its layers' weights do not fit in cache either).

    python benchmarks/linear_kernels.py [--rows 1 4 8 16 32 64] [--shapes 2048x1024 ...]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.machine import describe  # noqa: E402
from kernels.cpu_linear import Bf16Linear  # noqa: E402

BENCH_SHAPES = ["2048x1024", "1024x1024", "5632x1024", "1024x2816"]  # N x K: qkv, o_proj, gate_up, down


def _best_seconds(fn, iters: int, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - start) / iters)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    ap.add_argument("--shapes", nargs="+", default=BENCH_SHAPES, help="N x K of each weight")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--weight-mib", type=int, default=96,
                    help="bf16 MiB of weight copies cycled through per shape (well over the last-level cache)")
    ap.add_argument("--threads", type=int, default=None, help="torch (and kernel) threads; default torch's")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(describe())
    print(f"torch threads: {torch.get_num_threads()}")
    kernel = Bf16Linear(Path(tempfile.mkdtemp(prefix="pd-linear-bench-")))
    print("| N x K | rows | oneDNN fp32 packed GFLOP/s | bf16 kernel GFLOP/s | kernel/oneDNN |")
    print("|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split("x"))
        weight = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
        copies = max(1, -(-(args.weight_mib << 20) // weight.nbytes))
        fp32_packed = [torch.ops.mkldnn._reorder_linear_weight(weight.float(), 16) for _ in range(copies)]
        panels = [Bf16Linear.pack(weight, None) for _ in range(copies)]
        turn = [0]
        for rows in args.rows:
            x = torch.randn(rows, k, generator=g).to(torch.bfloat16)

            def onednn():
                turn[0] = (turn[0] + 1) % copies
                w = fp32_packed[turn[0]]
                torch.ops.mkldnn._linear_pointwise(x.float(), w, None, "none", [], "").to(torch.bfloat16)

            def ours():
                turn[0] = (turn[0] + 1) % copies
                kernel(x, panels[turn[0]])

            t_onednn, t_ours = float("inf"), float("inf")
            for _ in range(2):  # alternate so that a busy moment hits both
                t_onednn = min(t_onednn, _best_seconds(onednn, args.iters, args.repeats))
                t_ours = min(t_ours, _best_seconds(ours, args.iters, args.repeats))
            flops = 2.0 * rows * n * k
            print(f"| {n}x{k} | {rows} | {flops / t_onednn / 1e9:.1f} | {flops / t_ours / 1e9:.1f} "
                  f"| {t_onednn / t_ours:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
