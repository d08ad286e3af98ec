"""Achieved bandwidth (GB/s) and, for attention, TFLOP/s of the Triton kernels vs the torch reference.

Both paths run in the same process on the same CUDA tensors; the figure of merit is the
ratio triton/torch. Bytes count the minimum traffic (each KV element read or written once).
Without a CUDA GPU this prints that GPU performance is unmeasured and exits 0.
`--cpu-smoke` runs tiny shapes in Triton's interpreter only to check the script itself
(its timings mean nothing).

    python benchmarks/kernels.py [--dtype bfloat16] [--heads 32] [--kv-heads 8] [--head-dim 128]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Shape:
    dtype: str = "bfloat16"
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    num_seqs: int = 64
    seq_len: int = 2048  # decode context per sequence
    long_seq_len: int = 32768  # one lone long decode: the split-KV (flash-decoding) case
    prefill_len: int = 1024  # new tokens per sequence in the context-attention case
    prefix_len: int = 1024  # cached tokens before them
    prefill_seqs: int = 4
    layers: int = 32  # layers moved per multi-layer transfer launch
    transfer_tokens: int = 256  # one connector chunk


SMOKE = Shape(dtype="float32", heads=4, kv_heads=2, head_dim=64, num_seqs=2, seq_len=40, long_seq_len=600,
              prefill_len=20,
              prefix_len=16, prefill_seqs=2, layers=2, transfer_tokens=24)


def bench(fn: Callable[[], object], device: str, reps: int) -> float:
    """Median seconds per call (after warm-up)."""
    import torch

    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def paged_setup(s: Shape, seq_lens: list[int], q_lens: list[int], device: str):
    import torch

    dtype = getattr(torch, s.dtype)
    per_seq = [-(-n // s.block_size) for n in seq_lens]
    num_blocks = sum(per_seq)
    cache = torch.randn(2, num_blocks, s.block_size, s.kv_heads, s.head_dim, device=device, dtype=dtype)
    perm = torch.randperm(num_blocks, device=device).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(per_seq), dtype=torch.int32, device=device)
    used = 0
    for b, nb in enumerate(per_seq):
        tables[b, :nb] = perm[used:used + nb]
        used += nb
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    query = torch.randn(sum(q_lens), s.heads, s.head_dim, device=device, dtype=dtype)
    return query, cache, tables, qsl.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device)


def cases(s: Shape, device: str) -> list[tuple[str, Callable, Callable, float, float]]:
    """(name, triton call, torch call, bytes moved, flops) per kernel."""
    import torch

    from pdserve.kernels import torch_ref, triton_attention, triton_transfer

    dtype = getattr(torch, s.dtype)
    es = torch.empty((), dtype=dtype).element_size()
    token_kv = 2 * s.kv_heads * s.head_dim * es  # bytes of one token's K+V in one layer
    out = []

    n = s.num_seqs * 16
    key = torch.randn(n, s.kv_heads, s.head_dim, device=device, dtype=dtype)
    cache = torch.zeros(2, n // s.block_size * 2, s.block_size, s.kv_heads, s.head_dim, device=device, dtype=dtype)
    slots = torch.randperm(cache.shape[1] * s.block_size, device=device)[:n]
    out.append((f"reshape_and_cache n={n}", lambda: triton_transfer.reshape_and_cache(key, key, cache, slots),
                lambda: torch_ref.reshape_and_cache(key, key, cache, slots), 2 * n * token_kv, 0.0))

    layer_caches = [cache.clone() for _ in range(s.layers)]
    t = s.transfer_tokens
    tslots = slots[:t]
    buf = triton_transfer.gather_kv_layers(layer_caches, tslots)
    out.append((f"gather_kv_layers L={s.layers} n={t}", lambda: triton_transfer.gather_kv_layers(layer_caches, tslots),
                lambda: torch_ref.gather_kv_layers(layer_caches, tslots), 2 * s.layers * t * token_kv, 0.0))
    out.append((f"scatter_kv_layers L={s.layers} n={t}",
                lambda: triton_transfer.scatter_kv_layers(layer_caches, tslots, buf),
                lambda: torch_ref.scatter_kv_layers(layer_caches, tslots, buf), 2 * s.layers * t * token_kv, 0.0))

    scale = s.head_dim ** -0.5
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device == "cuda" else 1
    for num_seqs, seq_len in ((s.num_seqs, s.seq_len), (1, s.long_seq_len)):
        dec = paged_setup(s, [seq_len] * num_seqs, [1] * num_seqs, device)
        splits = triton_attention.num_kv_splits(num_seqs, s.kv_heads, seq_len, sms)  # what the engine picks
        kv_tokens = seq_len * num_seqs
        out.append((f"decode attention seqs={num_seqs} ctx={seq_len} splits={splits}",
                    lambda dec=dec, splits=splits, seq_len=seq_len: triton_attention.paged_decode_attention(
                        *dec, scale, num_splits=splits, max_seq_len=seq_len),
                    lambda dec=dec: torch_ref.paged_attention(*dec, scale),
                    kv_tokens * token_kv + 2 * dec[0].numel() * es, 4.0 * kv_tokens * s.heads * s.head_dim))

    total = s.prefix_len + s.prefill_len
    ctx = paged_setup(s, [total] * s.prefill_seqs, [s.prefill_len] * s.prefill_seqs, device)
    visible = s.prefill_seqs * sum(s.prefix_len + j + 1 for j in range(s.prefill_len))
    out.append((f"context attention seqs={s.prefill_seqs} new={s.prefill_len} prefix={s.prefix_len}",
                lambda: triton_attention.context_attention(*ctx, scale, s.prefill_len),
                lambda: torch_ref.paged_attention(*ctx, scale),
                s.prefill_seqs * total * token_kv + 2 * ctx[0].numel() * es,
                4.0 * visible * s.heads * s.head_dim))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field, default in vars(Shape()).items():
        parser.add_argument("--" + field.replace("_", "-"), type=type(default), default=default)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes in the Triton interpreter")
    args = parser.parse_args()
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        shape, device, reps = SMOKE, "cpu", 1
    else:
        import torch

        if not torch.cuda.is_available():
            print("No CUDA GPU present: GPU performance of the Triton kernels is unmeasured "
                  "(correctness is covered by tests/kernels/test_triton.py in the interpreter).")
            return 0
        shape = Shape(**{f: getattr(args, f) for f in vars(Shape())})
        device, reps = "cuda", args.reps
        print(f"device: {torch.cuda.get_device_name()}  shape: {shape}")
    print(f"{'kernel':<52} {'triton ms':>10} {'GB/s':>8} {'TFLOP/s':>8} {'torch ms':>10} {'GB/s':>8} {'speedup':>8}")
    for name, tri, ref, nbytes, flops in cases(shape, device):
        t_tri, t_ref = bench(tri, device, reps), bench(ref, device, reps)
        tflops = f"{flops / t_tri / 1e12:8.2f}" if flops else f"{'-':>8}"
        print(f"{name:<52} {t_tri * 1e3:10.3f} {nbytes / t_tri / 1e9:8.1f} {tflops} "
              f"{t_ref * 1e3:10.3f} {nbytes / t_ref / 1e9:8.1f} {t_ref / t_tri:7.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
