"""One decode step of the engine at a given batch and context length, with its per-part breakdown.

Default: the `bench` model, 16 requests whose prompts (576 tokens) are prefilled first
(untimed), then --steps decode steps timed one by one (contexts ~577..600 tokens): the figure.
Then --steps more with each part's calls timed (the wrappers cost Python time of their own, so
these steps are not the figure): attention (the backend: cache write +
paged attention, per layer), linear layers (qkv/o/gate-up/down projections), logits + sampling,
and the rest (embedding, norms, RoPE, scheduling, input preparation, output processing).
The bar: <= 25 ms per step at batch 16 with ~600-token contexts. On CPU it then prints this
machine's floor for such a step (benchmarks/roofline.py), measured in the same run.

    .venv/bin/python benchmarks/decode_step.py [--batch 16] [--context 576] [--steps 24]
        [--attention-backend auto|torch|cpu]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tqdm import tqdm  # noqa: E402

from pdserve.engine import SamplingParams  # noqa: E402
from pdserve.engine.llm_engine import LLMEngine  # noqa: E402

from engine_throughput import bench_model_path, prompts  # noqa: E402
from machine import describe  # noqa: E402
from roofline import decode_floor  # noqa: E402
from timing import engine_parts, print_parts  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="HF model directory (default: the bench preset)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=576, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=24, help="timed decode steps")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--device", default="auto", help="engine device: auto|cpu|cuda|cuda:N (default auto)")
    args = parser.parse_args()
    path = args.model or bench_model_path()
    print(describe(), flush=True)
    engine = LLMEngine.from_kwargs(str(path), kv_cache_memory="1GiB", max_num_seqs=args.batch,
                                   max_num_batched_tokens=max(2048, args.context + args.batch),
                                   attention_backend=args.attention_backend, device=args.device)
    runner = engine.model_runner
    print(f"model {path}, batch {args.batch}, prompts {args.context} tokens, device {runner.device}, "
          f"attention backend {runner.attn_backend.name}", flush=True)
    params = SamplingParams(max_tokens=2 * args.steps + 4, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts(args.batch, args.context, seed=3)):
        engine.add_request(f"decode-{i}", prompt, params)
    requests = list(engine.scheduler.requests.values())
    with tqdm(desc="prefill", total=args.batch, unit="req") as bar:
        while any(r.num_output_tokens == 0 for r in requests):
            engine.step()
            bar.n = sum(r.num_output_tokens > 0 for r in requests)
            bar.refresh()
    for _ in range(2):  # warm-up decode steps
        engine.step()

    step_ms = _timed_steps(engine, args.steps, "decode steps")  # the figure: nothing else timed inside
    timer = engine_parts(runner)  # from here on every part's calls are wrapped (Python time of their own)
    parts_ms = _timed_steps(engine, args.steps, "decode steps, timed by part")
    ctx = args.context + 1 + 2
    print(f"\ndecode step, batch {args.batch}, contexts {ctx}..{ctx + args.steps - 1} tokens: "
          f"mean {statistics.mean(step_ms):.1f} ms, median {statistics.median(step_ms):.1f} ms, "
          f"min {min(step_ms):.1f} ms (bar: <= 25 ms)")
    print(f"per part, over the next {args.steps} steps with each part's calls timed (median "
          f"{statistics.median(parts_ms):.1f} ms: the wrappers' own time lands in the parts and 'rest'):")
    if runner.device.type == "cuda":
        print("(CUDA: the parts are host time spent launching them; the step time includes the device's work)")
    print_parts(timer.totals, sum(parts_ms) / 1000, per=args.steps)
    engine.shutdown()
    if runner.device.type == "cpu":
        print(decode_floor(runner, args.batch, ctx + args.steps // 2).describe())


def _timed_steps(engine: LLMEngine, steps: int, desc: str) -> list[float]:
    """Wall ms of each of `steps` engine steps."""
    step_ms = []
    for _ in tqdm(range(steps), desc=desc, unit="step"):
        start = time.perf_counter()
        engine.step()
        step_ms.append((time.perf_counter() - start) * 1000)
    return step_ms


if __name__ == "__main__":
    main()
