"""Compile every Triton kernel variant ahead of time for a CUDA GPU, on any machine (no GPU needed).

The interpreter tests (tests/kernels/test_triton.py) check what the kernels compute, but the
interpreter runs them as numpy and accepts code Triton's compiler would reject. This runs the
host wrappers with their launches captured instead of executed, and compiles each captured
launch down to a cubin for the target architecture (default sm_90: H100/H200) with exactly
those argument types and constexprs. It takes minutes on a CPU, so it is `make check-kernels`,
not part of `make test`; run it with the Triton the GPU machine has (3.6 there) to check API
compatibility before spending GPU time:

    python -m pdserve.kernels.compile_check [--arch 90]

TRITON_INTERPRET must be unset (the kernels must be real JITFunctions).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch


def capture_launches() -> list[tuple]:
    """(jit function, args, kwargs) of every launch the wrappers make for the engine's shapes."""
    from pdserve.kernels import triton_attention as ta
    from pdserve.kernels import triton_transfer as tt

    launches = []

    class Capture:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.fn, args, kwargs))

    names = ((ta, "_paged_attention_kernel"), (ta, "_reduce_splits_kernel"), (tt, "_kv_slot_copy_kernel"))
    originals = [(module, name, getattr(module, name)) for module, name in names + ((ta, "_dot_dtype"),)]
    for module, name, fn in originals[:-1]:
        setattr(module, name, Capture(fn))
    dot_dtype = ta._dot_dtype
    ta._dot_dtype = lambda dtype, on_gpu: dot_dtype(dtype, True)  # the CPU tensors here stand for GPU ones
    try:
        for dtype in (torch.float32, torch.bfloat16):
            ta.paged_decode_attention(*_paged(dtype, [300, 40], [1, 1]), 0.1)
            ta.paged_decode_attention(*_paged(dtype, [3000, 40], [1, 1]), 0.1, num_splits=4, max_seq_len=3000)
            ta.context_attention(*_paged(dtype, [300, 40], [200, 7]), 0.1, max_query_len=200)
        cache = torch.zeros(2, 8, 16, 8, 128, dtype=torch.bfloat16)
        slots = torch.arange(20)
        rows = torch.zeros(20, 8, 128, dtype=torch.bfloat16)
        tt.reshape_and_cache(rows, rows, cache, slots)
        tt.gather_kv_layers([cache, cache.clone()], slots)
        tt.scatter_kv(cache, slots, torch.zeros(2, 20, 8, 128, dtype=torch.bfloat16))
    finally:
        for module, name, fn in originals:
            setattr(module, name, fn)
    return launches


def _paged(dtype, seq_lens, q_lens, heads=32, kv_heads=8, head_dim=128, block=16):
    blocks = sum(-(-s // block) for s in seq_lens)
    cache = torch.zeros(2, blocks, block, kv_heads, head_dim, dtype=dtype)
    tables = torch.zeros(len(seq_lens), max(-(-s // block) for s in seq_lens), dtype=torch.int32)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    qkv = torch.zeros(sum(q_lens), heads + 2 * kv_heads, head_dim, dtype=dtype)
    return qkv[:, :heads], cache, tables, qsl, torch.tensor(seq_lens, dtype=torch.int32)


_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "i32",
          torch.int64: "i64"}


def signature(fn, args, kwargs) -> tuple[dict, dict]:
    """Triton's signature and constexprs of one launch."""
    values = dict(zip(fn.arg_names, args), **kwargs)
    sig, consts = {}, {}
    for param in fn.params:
        value = values[param.name]
        if param.is_constexpr:
            sig[param.name], consts[param.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            sig[param.name] = "*" + _TYPES[value.dtype]
        elif isinstance(value, float):
            sig[param.name] = "fp32"
        else:
            sig[param.name] = "i64" if abs(int(value)) >= 2**31 else "i32"
    return sig, consts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Compile every pdserve Triton kernel variant for a CUDA arch.")
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10 (default 90)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("unset TRITON_INTERPRET: the interpreter does not compile")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    seen = set()
    for fn, fargs, fkwargs in capture_launches():
        sig, consts = signature(fn, fargs, fkwargs)
        key = (fn.__name__, tuple(sig.items()), tuple((k, str(v)) for k, v in consts.items()))
        if key in seen:
            continue
        seen.add(key)
        started = time.perf_counter()
        kernel = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", args.arch, 32))
        shown = {k: str(v) for k, v in consts.items() if k in ("SPLIT_KV", "DOT_DTYPE", "BLOCK_Q", "LAYERED",
                                                                "TO_CACHE", "CACHE_DTYPE")}
        print(json.dumps({"kernel": fn.__name__, **shown, "cubin_bytes": len(kernel.asm["cubin"]),
                          "seconds": round(time.perf_counter() - started, 1)}), flush=True)
    print(f"triton {triton.__version__}: {len(seen)} kernel variants compiled for sm_{args.arch}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
