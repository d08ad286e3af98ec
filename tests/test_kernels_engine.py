"""Greedy generation with the Triton kernels forced on (interpreter) matches the torch path token for token.

The Triton run happens in a fresh interpreter process: TRITON_INTERPRET must be set before
the kernel modules are imported, which a shared pytest process cannot guarantee.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from kernels import ops

REPO = Path(__file__).resolve().parents[1]
# Shared 40-byte prefix (> 2 blocks of 16) so the second round hits the prefix cache and the
# context kernel attends over a cached paged prefix; a 32-token budget chunks the prefills.
PREFIX = "The quick brown fox jumps over the lazy "
ROUNDS = [[PREFIX + "dog.", "Hi"], [PREFIX + "cat, twice."]]
ENGINE_OPTIONS = dict(block_size=16, kv_cache_memory="8MiB", max_num_batched_tokens=32)
MAX_TOKENS = 6

TRITON_RUN = """
import json, sys
from kernels import triton_attention, triton_transfer
from tests.kernels_helpers import count_calls
from tests.test_kernels_engine import generate_rounds
calls = count_calls([(triton_transfer, "reshape_and_cache"), (triton_attention, "paged_decode_attention"),
                     (triton_attention, "context_attention")])
print(json.dumps({**generate_rounds(sys.argv[1]), "calls": calls}))
"""


def generate_rounds(model: str) -> dict[str, list]:
    """Greedy generation of each round in turn on one LLM: generated tokens and cached prompt tokens."""
    from serving import LLM, SamplingParams

    llm = LLM(model, **ENGINE_OPTIONS)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    results = [llm.generate(prompts, params) for prompts in ROUNDS]
    return {"tokens": [[list(r.token_ids) for r in rnd] for rnd in results],
            "cached": [[r.num_cached_tokens for r in rnd] for rnd in results]}


def test_triton_greedy_generation_matches_torch(tiny_llama: Path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PDSERVE_KERNELS": "triton", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", TRITON_RUN, str(tiny_llama)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    triton_run = json.loads(proc.stdout.strip().splitlines()[-1])
    with ops.use_backend("torch"):
        torch_run = generate_rounds(str(tiny_llama))

    assert all(len(seq) == MAX_TOKENS for rnd in torch_run["tokens"] for seq in rnd)
    assert triton_run["tokens"] == torch_run["tokens"]
    assert triton_run["cached"][1][0] >= 32  # round 2 attended over a cached paged prefix
    assert all(triton_run["calls"].get(name, 0) > 0
               for name in ("reshape_and_cache", "paged_decode_attention", "context_attention"))
