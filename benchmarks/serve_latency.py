"""Serving latency of `pd-serve` at fixed concurrency: TTFT, inter-token latency, output tokens/s.

Closed loop: at concurrency c, c clients each send streaming requests back to back until
`requests-per-client x c` requests are done (EOS ignored, so each yields exactly --output-len
tokens). Per request: TTFT (send -> first token), ITL (gaps between tokens), output tokens/s
(tokens / time to the last token); p50/p99 of each, TTFT and ITL as pd-bench's client times them
(pdserve.bench.client: a chunk of k tokens counts k gaps of a k-th of its wait each). Each level (and the baseline) first runs a
short warm-up at the same concurrency: CPU kernels specialise per shape on first use.
Baseline in the same run: the offline engine (`LLM.generate`, no HTTP, no async thread) on
a batch of c such prompts; the ratio served/offline of aggregate output tokens/s shows what
serving costs.

    .venv/bin/python benchmarks/serve_latency.py [--model DIR] [--concurrency 1,8,32]
        [--prompt-len 128] [--output-len 32] [--requests-per-client 2] [--kv-cache-memory 512MiB]
"""
from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import aiohttp

from pdserve.bench.client import RequestRecord, stream
from pdserve.bench.stats import percentile
from pdserve.deploy.server_process import ServerProcess

from engine_throughput import bench_model_path, prompts


async def one_request(session: aiohttp.ClientSession, url: str, prompt: list[int], output_len: int) -> RequestRecord:
    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    rec = await stream(session, url + "/v1/completions", body)
    assert rec.ok, rec.error
    assert len(rec.token_ids) == output_len, f"got {len(rec.token_ids)} tokens, expected {output_len}"
    return rec


def tok_s(rec: RequestRecord) -> float:
    """Output tokens per second from sending the request to its last token."""
    return len(rec.token_ids) / (rec.ttft + sum(rec.itl))


async def run_level(url: str, concurrency: int, per_client: int, prompt_len: int, output_len: int) -> dict:
    """All requests of one level; fresh prompts (seeded by the level) so earlier levels' prefix-cache
    entries do not flatter this one."""
    batch = prompts(concurrency * per_client, prompt_len, seed=concurrency + 10_000 * per_client)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        async def client(k: int) -> list[RequestRecord]:
            return [await one_request(session, url, batch[k * per_client + i], output_len)
                    for i in range(per_client)]

        start = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(client(k) for k in range(concurrency))) for r in rs]
        wall = time.perf_counter() - start
    return {"results": results, "agg_tok_s": len(results) * output_len / wall}


def offline_tok_s(args: argparse.Namespace) -> dict[int, float]:
    """Aggregate output tokens/s of LLM.generate on a batch of c fresh prompts, per concurrency c."""
    from pdserve.serving import LLM, SamplingParams

    llm = LLM(str(args.model), kv_cache_memory=args.kv_cache_memory, device=args.device)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    out = {}
    for c in args.concurrency:
        llm.generate(prompts(c, args.prompt_len, seed=2000 + c), params)  # warm-up at this shape
        batch = prompts(c, args.prompt_len, seed=1000 + c)
        start = time.perf_counter()
        llm.generate(batch, params)
        out[c] = c * args.output_len / (time.perf_counter() - start)
    return out


def main(args: argparse.Namespace) -> None:
    print(f"model {args.model}; prompt {args.prompt_len} tokens, output {args.output_len} tokens, "
          f"{args.requests_per_client} requests per client", flush=True)
    server = ServerProcess("--model", str(args.model), "--kv-cache-memory", args.kv_cache_memory,
                           "--device", args.device).start(timeout=600)
    try:
        levels = {}
        for c in args.concurrency:
            # Warm-up at this concurrency first: the CPU kernels are specialised per shape on first use.
            asyncio.run(run_level(server.url, c, 1, args.prompt_len, 4))
            levels[c] = asyncio.run(run_level(server.url, c, args.requests_per_client, args.prompt_len,
                                              args.output_len))
    finally:
        server.stop()
    baseline = offline_tok_s(args)
    header = (f"{'conc':>4} {'reqs':>4} | {'TTFT p50':>9} {'TTFT p99':>9} | {'ITL p50':>8} {'ITL p99':>8} | "
              f"{'tok/s/req p50':>13} {'p99':>6} | {'agg tok/s':>9} {'offline':>8} {'ratio':>6}")
    print(header)
    print("-" * len(header))
    for c, lv in levels.items():
        res = lv["results"]
        ttft = [r.ttft * 1e3 for r in res]
        itl = [g * 1e3 for r in res for g in r.itl]
        tps = [tok_s(r) for r in res]
        print(f"{c:>4} {len(res):>4} | {percentile(ttft, 50):>7.0f}ms {percentile(ttft, 99):>7.0f}ms | "
              f"{percentile(itl, 50):>6.1f}ms {percentile(itl, 99):>6.1f}ms | {percentile(tps, 50):>13.1f} "
              f"{percentile(tps, 1):>6.1f} | {lv['agg_tok_s']:>9.1f} {baseline[c]:>8.1f} "
              f"{lv['agg_tok_s'] / baseline[c]:>5.2f}x")
    print("tok/s/req p99 is the slow tail (1st percentile of per-request speed); ratio = served / offline "
          "aggregate output tokens/s at the same concurrency")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="model dir (default: the bench model)")
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--kv-cache-memory", default="512MiB")
    parser.add_argument("--device", default="auto", help="engine device: auto|cpu|cuda|cuda:N (default auto)")
    args = parser.parse_args()
    args.model = args.model or bench_model_path()
    main(args)
