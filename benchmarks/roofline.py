"""What this machine allows one decode step: a floor to read the decode-step figure against.

A decode step multiplies `batch` activation rows by every weight matrix and reads every
request's keys and values once per layer. Neither can beat the machine: the linear layers need
at least max(FLOPs / peak GEMM rate, weight bytes / memory bandwidth) and attention at least
KV bytes / memory bandwidth. Both rates are measured here, in the same run, with the engine's
own paths: the peak GEMM rate through engine/models/linear.py's `Linear` at a large batch (so
an AVX2-only CPU is measured on the compiled bf16 kernel the engine takes there, an AMX one on
oneDNN's native bf16), the bandwidth as a multi-threaded sum over a buffer far larger than the
last-level cache.
The floor ignores everything else in a step (norms, RoPE, sampling, Python), so it is a bound
no implementation reaches, not a target.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.engine.models.linear import Linear


def _best_seconds(fn, repeats: int) -> float:
    fn()  # first call: packing, page faults, kernel selection
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def peak_gemm_flops(dtype: torch.dtype, rows: int = 256, size: int = 2048) -> float:
    """FLOP/s of the engine's Linear on a [rows, size] x [size, size] product, best of several."""
    layer = Linear(size, size, bias=False, dtype=dtype)
    layer.weight.data.normal_(0, 0.02)
    layer.pack()
    x = torch.randn(rows, size).to(dtype)
    with torch.inference_mode():
        seconds = _best_seconds(lambda: layer(x), 8)
    return 2 * rows * size * size / seconds


def memory_bandwidth(nbytes: int = 512 << 20) -> float:
    """Bytes/s of a multi-threaded read of a buffer far larger than the caches, best of several."""
    buf = torch.ones(nbytes // 4)
    return nbytes / _best_seconds(lambda: buf.sum(), 5)


@dataclass(frozen=True)
class DecodeFloor:
    gemm_flops: float  # measured peak, FLOP/s
    bandwidth: float  # measured, bytes/s
    linear_flops: float  # per step
    weight_bytes: float  # per step, in the checkpoint's dtype
    kv_bytes: float  # per step

    @property
    def linear_s(self) -> float:
        return max(self.linear_flops / self.gemm_flops, self.weight_bytes / self.bandwidth)

    @property
    def attention_s(self) -> float:
        return self.kv_bytes / self.bandwidth

    def describe(self) -> str:
        return (f"this machine's floor for the step: {(self.linear_s + self.attention_s) * 1e3:.1f} ms = linear "
                f"{self.linear_s * 1e3:.1f} ms ({self.linear_flops / 1e9:.2f} GFLOP at the measured peak "
                f"{self.gemm_flops / 1e9:.0f} GFLOP/s; {self.weight_bytes / 1e6:.0f} MB of weights) + attention "
                f"{self.attention_s * 1e3:.1f} ms ({self.kv_bytes / 1e6:.0f} MB of KV at the measured "
                f"{self.bandwidth / 1e9:.1f} GB/s)")


def decode_floor(runner: Any, batch: int, context_tokens: int) -> DecodeFloor:
    """The floor of one decode step of `batch` requests with `context_tokens` keys each, for the
    model of `runner` (engine/model_runner.py: its derived head_dim, kv heads, layers and dtype)."""
    c, layers = runner.hf_config, runner.num_layers
    q, kv = c.num_attention_heads * runner.head_dim, runner.num_kv_heads * runner.head_dim
    per_layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    params = layers * per_layer + c.hidden_size * runner.vocab_size  # + lm_head
    elem = runner.dtype.itemsize
    return DecodeFloor(gemm_flops=peak_gemm_flops(runner.dtype), bandwidth=memory_bandwidth(),
                       linear_flops=2.0 * batch * params, weight_bytes=float(params * elem),
                       kv_bytes=float(batch * context_tokens * layers * 2 * kv * elem))
