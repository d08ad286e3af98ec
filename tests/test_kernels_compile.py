"""Every Triton kernel compiles for a Hopper GPU (sm_90) with the installed Triton, on a CPU machine.

The interpreter tests (test_kernels.py) check what the kernels compute, but the interpreter
runs them as numpy and accepts code Triton's compiler would reject. Here the host wrappers run
with their launches captured instead of executed, and each captured launch is compiled ahead
of time down to a cubin with exactly those argument types and constexprs. The run happens in
a fresh interpreter: the kernels must be real JITFunctions, so TRITON_INTERPRET must be unset
before triton is imported.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

COMPILE_RUN = r"""
import json, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import triton_attention as ta, triton_transfer as tt

TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "i32",
         torch.int64: "i64"}
launches = []

class Capture:
    def __init__(self, fn):
        self.fn = fn
    def __getitem__(self, grid):
        return lambda *args, **kwargs: launches.append((self.fn, args, kwargs))

for module, name in ((ta, "_paged_attention_kernel"), (ta, "_reduce_splits_kernel"), (tt, "_kv_slot_copy_kernel")):
    setattr(module, name, Capture(getattr(module, name)))

def paged(dtype, seq_lens, q_lens, heads=32, kv_heads=8, head_dim=128, block=16):
    blocks = sum(-(-s // block) for s in seq_lens)
    cache = torch.zeros(2, blocks, block, kv_heads, head_dim, dtype=dtype)
    tables = torch.zeros(len(seq_lens), max(-(-s // block) for s in seq_lens), dtype=torch.int32)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    qkv = torch.zeros(sum(q_lens), heads + 2 * kv_heads, head_dim, dtype=dtype)
    return qkv[:, :heads], cache, tables, qsl, torch.tensor(seq_lens, dtype=torch.int32)

for dtype in (torch.float32, torch.bfloat16):
    ta.paged_decode_attention(*paged(dtype, [300, 40], [1, 1]), 0.1)
    ta.paged_decode_attention(*paged(dtype, [3000, 40], [1, 1]), 0.1, num_splits=4, max_seq_len=3000)
    ta.context_attention(*paged(dtype, [300, 40], [200, 7]), 0.1, max_query_len=200)
cache = torch.zeros(2, 8, 16, 8, 128, dtype=torch.bfloat16)
slots = torch.arange(20)
tt.reshape_and_cache(torch.zeros(20, 8, 128, dtype=torch.bfloat16), torch.zeros(20, 8, 128, dtype=torch.bfloat16),
                     cache, slots)
tt.gather_kv_layers([cache, cache.clone()], slots)
tt.scatter_kv(cache, slots, torch.zeros(2, 20, 8, 128, dtype=torch.bfloat16))

def signature(fn, args, kwargs):
    values = dict(zip(fn.arg_names, args), **kwargs)
    sig, consts = {}, {}
    for param in fn.params:
        value = values[param.name]
        if param.is_constexpr:
            sig[param.name], consts[param.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            sig[param.name] = "*" + TYPES[value.dtype]
        elif isinstance(value, float):
            sig[param.name] = "fp32"
        else:
            sig[param.name] = "i64" if abs(int(value)) >= 2**31 else "i32"
    return sig, consts

compiled, seen = [], set()
for fn, args, kwargs in launches:
    sig, consts = signature(fn, args, kwargs)
    key = (fn.__name__, tuple(sig.items()), tuple((k, str(v)) for k, v in consts.items()))
    if key in seen:
        continue
    seen.add(key)
    kernel = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))
    compiled.append({"kernel": fn.__name__, "cubin_bytes": len(kernel.asm["cubin"]),
                     "constexprs": {k: str(v) for k, v in consts.items()}})
print(json.dumps({"triton": triton.__version__, "compiled": compiled}))
"""


def test_every_kernel_variant_compiles_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9 warns when unset; fusion on is what every version does
    proc = subprocess.run([sys.executable, "-c", COMPILE_RUN], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    kinds = {(c["kernel"], c["constexprs"].get("SPLIT_KV"), c["constexprs"].get("LAYERED"),
              c["constexprs"].get("TO_CACHE")) for c in result["compiled"]}
    assert ("_paged_attention_kernel", "True", None, None) in kinds  # split-KV decode
    assert ("_paged_attention_kernel", "False", None, None) in kinds  # decode and context
    assert ("_reduce_splits_kernel", None, None, None) in kinds
    assert {("_kv_slot_copy_kernel", None, layered, to_cache)
            for layered, to_cache in (("False", "True"), ("True", "False"))} <= kinds
    assert all(c["cubin_bytes"] > 0 for c in result["compiled"])
