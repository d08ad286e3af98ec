"""Output tokens/s of our engine vs Hugging Face `generate` (batched) on the same prompts, in one run.

Default workload: the `bench` random-weight model, 16 requests x 512 prompt tokens + 128 output
tokens (EOS ignored, so every request produces exactly 128 tokens). Each side gets one small
warm-up run first; the timed figure covers prefill and decode (wall clock of the whole batch),
best of --repeats interleaved runs.
The bar: ours >= 2x HF.

    .venv/bin/python benchmarks/engine_throughput.py [--model DIR] [--num-requests 16]
        [--prompt-len 512] [--output-len 128] [--repeats 1] [--device auto|cpu|cuda]
"""
from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from pdserve.engine.builtin_model import default_model_path  # noqa: E402
from pdserve.serving import LLM, SamplingParams  # noqa: E402

from timing import engine_parts, print_parts  # noqa: E402


def bench_model_path() -> Path:
    return default_model_path(preset="bench")


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 259) for _ in range(length)] for _ in range(n)]


def run_ours(llm: LLM, batch: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
    """(wall seconds, output token ids per prompt) of one greedy LLM.generate over the batch."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(batch, params)
    elapsed = time.perf_counter() - start
    assert all(len(o.token_ids) == output_len for o in outs)
    return elapsed, [list(o.token_ids) for o in outs]


def run_hf(model, batch: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
    """(wall seconds, output token ids per prompt) of one greedy batched HF generate."""
    width = max(map(len, batch))  # left padding, masked out, where lengths differ
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=mask, do_sample=False,
                             max_new_tokens=output_len, min_new_tokens=output_len, pad_token_id=0)
        out = out.cpu()  # the last token has been computed, on any device
    elapsed = time.perf_counter() - start
    assert out.shape == (len(batch), input_ids.shape[1] + output_len)
    return elapsed, out[:, input_ids.shape[1]:].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="HF model directory (default: the bench preset)")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=1, help="interleaved runs per side; the best counts")
    parser.add_argument("--device", default="auto", help="auto|cpu|cuda|cuda:N, for both sides (default auto)")
    args = parser.parse_args()
    from pdserve.engine.device import resolve_device
    from transformers import AutoModelForCausalLM

    path = args.model or bench_model_path()
    batch = prompts(args.num_requests, args.prompt_len, seed=0)
    warm = prompts(2, 32, seed=1)
    total_out = args.num_requests * args.output_len
    print(f"model {path}, {args.num_requests} requests x {args.prompt_len} prompt + {args.output_len} output "
          f"tokens, torch threads {torch.get_num_threads()}", flush=True)

    # Enough KV for the whole batch (no preemption): 16 x 640 tokens of the bench model is ~250 MB.
    llm = LLM(str(path), device=args.device, kv_cache_memory="768MiB", max_num_seqs=max(args.num_requests, 1),
              max_num_batched_tokens=args.max_num_batched_tokens)
    model = AutoModelForCausalLM.from_pretrained(str(path)).to(resolve_device(args.device)).eval()
    run_ours(llm, warm, 4)
    run_hf(model, warm, 4)
    # Interleaved and best-of: the machine is shared, so each side gets the same chances.
    timer = engine_parts(llm.engine.model_runner)
    ours, hf, parts = float("inf"), float("inf"), {}
    for r in range(args.repeats):
        timer.reset()
        seconds = run_ours(llm, batch, args.output_len)[0]
        if seconds < ours:
            ours, parts = seconds, dict(timer.totals)
        print(f"[run {r}] pdserve engine {seconds:.2f} s", flush=True)
        hf = min(hf, run_hf(model, batch, args.output_len)[0])
        print(f"[run {r}] HF generate {hf:.2f} s", flush=True)
    print(f"pdserve engine:  {ours:7.2f} s, {total_out / ours:8.1f} output tokens/s")
    print(f"HF generate:     {hf:7.2f} s, {total_out / hf:8.1f} output tokens/s (dtype {model.dtype})")
    print(f"ratio: {hf / ours:.2f}x (bar: >= 2x)")
    print("\nwhere pdserve's best run went (prefill and decode together):")
    print_parts(parts, ours, unit="ms in the run")

if __name__ == "__main__":
    main()
