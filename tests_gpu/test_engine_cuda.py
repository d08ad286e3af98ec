"""The engine on CUDA: outputs against HF on the same GPU, placement, syncs per step, memory sizing."""
from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from pdserve.engine.attention import ForwardContext, set_forward_context
from pdserve.engine.request import Request
from pdserve.engine.scheduler_output import SchedulerOutput
from pdserve.serving import LLM, SamplingParams
from tests_gpu.helpers import count_tolerated_divergences, hf_greedy_with_gaps, hf_model, prompt

REPO = Path(__file__).resolve().parents[1]
LENGTHS = [1, 15, 16, 17, 100, 255, 256, 257, 600, 2000]  # block (16) and chunk boundaries, split-KV decode
MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def refs(fp32_model):
    prompts = [prompt(n, seed=1) for n in LENGTHS]
    return prompts, *hf_greedy_with_gaps(fp32_model, prompts, MAX_TOKENS)


def test_greedy_fp32_equals_hf_on_cuda(fp32_model, refs):
    """Batched, chunked (512-token budget), then again over the prefix cache; every tensor on the GPU."""
    prompts, tokens, gaps = refs
    llm = LLM(str(fp32_model), device="cuda", dtype="float32", kv_cache_memory="2GiB", max_num_batched_tokens=512)
    runner = llm.engine.model_runner
    assert runner.device.type == "cuda" and runner.attn_backend.name == "triton"
    assert all(p.device.type == "cuda" for p in runner.model.parameters())
    assert all(c.device.type == "cuda" for c in runner.kv_caches)
    assert runner.model.rotary.cos.device.type == "cuda" and runner.sampler.generator.device.type == "cuda"
    first = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    count_tolerated_divergences(first, tokens, gaps, "fp32 batched + chunked")
    again = llm.generate(prompts, GREEDY)
    assert [o.num_cached_tokens for o in again] == [(n - 1) // 16 * 16 for n in LENGTHS]
    count_tolerated_divergences([o.token_ids for o in again], tokens, gaps, "fp32 over the prefix cache")
    alone = LLM(str(fp32_model), device="cuda:0", dtype="float32", kv_cache_memory="1GiB")  # one at a time:
    singles = [alone.generate([p], GREEDY)[0].token_ids for p in prompts[-3:]]  # lone long decodes split KV
    count_tolerated_divergences(singles, tokens[-3:], gaps[-3:], "fp32 one request at a time")


def test_one_device_to_host_sync_per_step(fp32_model):
    """Greedy steps sync the host exactly once: the sampled ids (torch's sync debug mode counts them)."""
    llm = LLM(str(fp32_model), device="cuda", dtype="float32", kv_cache_memory="1GiB")
    engine = llm.engine
    llm.generate([prompt(40, 2)], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up: kernels compiled
    for i, n in enumerate((30, 70, 5)):
        engine.add_request(f"s{i}", prompt(n, 3), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    steps = syncs = 0
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            while engine.has_unfinished_requests():
                engine.step()
                steps += 1
        syncs = sum("synchronizing CUDA operation" in str(w.message) for w in caught)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert steps == 6 and syncs == steps, f"{syncs} synchronizing CUDA operations in {steps} steps"


def _all_logits(runner, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Our logits for every position of `ids`: prefill in `chunks`, then one token per step."""
    req = Request("x", ids[:sum(chunks)], SamplingParams())
    table = list(range(-(-len(ids) // runner.block_size)))
    out = []
    plan = list(chunks) + [1] * (len(ids) - sum(chunks))
    for n in plan:
        if req.num_tokens < req.num_computed_tokens + n:
            req.append_output_token(ids[req.num_tokens])
        so = SchedulerOutput([req], {"x": n}, {"x": table}, n)
        inputs = runner.inputs.prepare(so)
        ctx = ForwardContext(inputs.attn_metadata, runner.kv_caches, runner.attn_backend)
        with torch.inference_mode(), set_forward_context(ctx):
            out.append(runner.model.compute_logits(runner.model(inputs.input_ids, inputs.positions)))
        req.num_computed_tokens += n
    return torch.cat(out)


def test_bf16_logits_within_tolerance(bf16_model):
    """Our bf16 logits are as close to HF's fp32 logits as HF's own bf16 logits are (chunked prefill + decode)."""
    ids = prompt(320, 4)
    llm = LLM(str(bf16_model), device="cuda", kv_cache_memory="512MiB")
    ours = _all_logits(llm.engine.model_runner, ids, [200, 100])
    with torch.inference_mode():
        ref32 = hf_model(bf16_model, torch.float32)(torch.tensor([ids], device="cuda")).logits[0].float()
        ref16 = hf_model(bf16_model, torch.bfloat16)(torch.tensor([ids], device="cuda")).logits[0].float()
    ours_err, hf_err = (ours - ref32).abs(), (ref16 - ref32).abs()
    print(f"bf16 vs fp32 logits: ours max {ours_err.max():.4f} mean {ours_err.mean():.5f}; "
          f"HF bf16 max {hf_err.max():.4f} mean {hf_err.mean():.5f}")
    assert ours.shape == ref32.shape
    assert float(ours_err.mean()) <= 2 * float(hf_err.mean()) + 1e-3
    assert float(ours_err.max()) <= 2 * float(hf_err.max()) + 0.05
    agree = (ours.argmax(-1) == ref16.argmax(-1)).float().mean()
    assert agree >= 0.97, f"argmax agrees with HF bf16 on {agree:.1%} of positions"


MEMORY_RUN = """
import json, logging, sys, torch
from pdserve.serving import LLM
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())
logging.basicConfig(level=logging.INFO)
logging.getLogger().addHandler(Keep())
llm = LLM(sys.argv[1], device="cuda", gpu_memory_utilization=float(sys.argv[2]))
runner = llm.engine.model_runner
free, total = torch.cuda.mem_get_info()
out = llm.generate([[5] * 300], None)
print(json.dumps({"kv": runner.kv_cache_memory, "blocks": runner.num_blocks, "total": total,
                  "peak": torch.cuda.max_memory_allocated(),
                  "lines": [m for m in records if m.startswith("KV cache memory:")], "tokens": len(out[0].token_ids)}))
"""


def test_gpu_memory_utilization_sizes_the_kv_cache(bf16_model):
    """A fresh process (nothing else on the GPU from this suite): the KV gets F x total minus the profile."""
    proc = subprocess.run([sys.executable, "-c", MEMORY_RUN, str(bf16_model), "0.3"], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    (line,) = got["lines"]
    assert line.startswith("KV cache memory: 0.30 x ") and line.endswith("GiB for KV")
    assert 0 < got["kv"] < 0.3 * got["total"] and got["blocks"] > 0 and got["tokens"] > 0
    assert got["peak"] <= 0.3 * got["total"] * 1.02  # the engine stayed within its share
