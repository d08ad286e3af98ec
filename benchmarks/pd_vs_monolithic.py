"""The same workload through a P/D cluster (pd-proxy -> pd-prefill + pd-decode) and one pd-serve.

Workload: --num-requests streaming requests sent at once (open loop), prompts of --prompt-len
tokens whose first --shared-fraction is one common prefix (a system prompt / few-shot
context) and the rest unique, --output-len tokens each (EOS ignored). Per path: TTFT,
inter-token latency and per-request output tokens/s (p50/p99), plus aggregate output
tokens/s. Both paths run in this one invocation on the same machine, one after the other,
and the P/D figures are also given as ratios to pd-serve.

The proxy's own cost (`--latency-only` runs just this part): short requests (max_tokens 1) sent
one at a time straight to the decode node's HTTP API vs through a proxy that has only that decode
node (same engine, same local prefill): the difference is the proxy's HTTP + gRPC hop.

    .venv/bin/python benchmarks/pd_vs_monolithic.py [--model DIR] [--num-requests 32]
        [--prompt-len 2048] [--shared-fraction 0.5] [--output-len 128] [--store file|redis|lmcache]
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from pdserve.bench.client import RequestRecord, stream
from pdserve.bench.stats import percentile
from pdserve.deploy.processes import HOST, Child, ClusterSpec, LocalCluster, free_port, python_module
from pdserve.deploy.server_process import ServerProcess

from engine_throughput import bench_model_path, prompts


def workload(n: int, length: int, shared_fraction: float, seed: int) -> list[list[int]]:
    shared = prompts(1, int(length * shared_fraction), seed)[0]
    return [shared + tail for tail in prompts(n, length - len(shared), seed + 1)]


async def one_request(session: aiohttp.ClientSession, url: str, prompt: list[int], output_len: int) -> RequestRecord:
    """Token arrival times from the SSE chunks' token_ids (pdserve.bench.client); the usage chunk confirms the
    count (a chunk whose text is still held back may be skipped by the server, so gaps are per visible chunk)."""
    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True, "stream_options": {"include_usage": True}}
    rec = await stream(session, url + "/v1/completions", body)
    assert rec.ok and rec.completion_tokens == output_len, (rec.error, rec.completion_tokens, len(rec.token_ids))
    return rec


async def run_batch(url: str, batch: list[list[int]], output_len: int) -> dict:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=7200)) as session:
        start = time.perf_counter()
        results = await asyncio.gather(*(one_request(session, url, p, output_len) for p in batch))
        wall = time.perf_counter() - start
    ttft = [r.ttft for r in results]
    itl = [g for r in results for g in r.itl]
    tok_s = [output_len / r.e2e for r in results]
    return {"ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99), "itl_p50": percentile(itl, 50),
            "itl_p99": percentile(itl, 99), "tok_s_p50": percentile(tok_s, 50), "tok_s_p99": percentile(tok_s, 1),
            "agg_tok_s": len(batch) * output_len / wall, "wall": wall}


async def short_latencies(urls: dict[str, str], n: int) -> dict[str, list[float]]:
    """End-to-end latency of n sequential one-token requests per path on fresh short prompts. The
    paths take turns request by request, so a slow moment of the machine costs each path alike."""
    out: dict[str, list[float]] = {name: [] for name in urls}
    async with aiohttp.ClientSession() as session:
        for i, prompt in enumerate(prompts(n, 16, seed=11)):
            for j, (name, url) in enumerate(urls.items()):
                body = {"prompt": [(t + j) % 200 + 10 for t in prompt], "max_tokens": 1, "temperature": 0}
                start = time.perf_counter()
                async with session.post(url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    await resp.read()
                out[name].append(time.perf_counter() - start)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model dir (default: the built-in bench model)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--shared-fraction", type=float, default=0.5)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--store", choices=("file", "redis", "lmcache"), default="file")
    p.add_argument("--kv-cache-memory", default="2GiB")
    p.add_argument("--device", default="auto", help="engine device of every node: auto|cpu|cuda|cuda:N")
    p.add_argument("--latency-probes", type=int, default=30)
    p.add_argument("--latency-only", action="store_true",
                   help="only the short-request latencies (the proxy's added cost); skip both workloads")
    args = p.parse_args()
    model = Path(args.model) if args.model else bench_model_path()
    engine_args = ["--device", args.device, "--kv-cache-memory", args.kv_cache_memory, "--max-model-len",
                   str(args.prompt_len + args.output_len + 16)]
    log_dir = Path(tempfile.mkdtemp(prefix="pd-vs-mono-"))
    print(f"model {model}; {args.num_requests} requests x {args.prompt_len} prompt tokens "
          f"({args.shared_fraction:.0%} shared prefix) x {args.output_len} output tokens; store {args.store}; "
          f"logs {log_dir}", flush=True)
    results: dict[str, dict] = {}
    latency: dict[str, list[float]] = {}

    cluster = LocalCluster(ClusterSpec(model=str(model), log_dir=log_dir, store=args.store,
                                       node_args=engine_args))
    direct_proxy = None
    try:
        cluster.start(timeout_s=600)
        decode = cluster.decode[0]
        port = free_port()  # a proxy with the decode node only: isolates the proxy hop
        direct_proxy = Child("proxy-decode-only", python_module(
            "pdserve.proxy", "--port", str(port), "--decode", decode.grpc_address), log_dir)
        direct_proxy.start()
        cluster.wait_healthy(1, 1)
        proxy_only_url, decode_url = f"http://{HOST}:{port}", f"http://{HOST}:{decode.http_port}"
        time.sleep(2.0)  # first health probe of the extra proxy
        asyncio.run(run_batch(cluster.url, workload(2, 256, 0.5, seed=7), 4))  # warm-up (kernel shapes)
        if not args.latency_only:
            results["P/D"] = asyncio.run(run_batch(cluster.url, workload(args.num_requests, args.prompt_len,
                                                                         args.shared_fraction, seed=1),
                                                   args.output_len))
        latency.update(asyncio.run(short_latencies({"decode node direct": decode_url,
                                                    "proxy -> decode node": proxy_only_url,
                                                    "proxy -> prefill -> decode": cluster.url},
                                                   args.latency_probes)))
    finally:
        if direct_proxy is not None:
            direct_proxy.stop()
        cluster.stop()

    if args.latency_only:
        print_latencies(latency)
        return 0
    with ServerProcess("--model", str(model), *engine_args) as mono:
        asyncio.run(run_batch(mono.url, workload(2, 256, 0.5, seed=7), 4))
        results["pd-serve"] = asyncio.run(run_batch(mono.url, workload(args.num_requests, args.prompt_len,
                                                                       args.shared_fraction, seed=1), args.output_len))

    base = results["pd-serve"]
    print(f"\n{'path':10} {'TTFT p50/p99 (s)':>18} {'ITL p50/p99 (ms)':>18} {'tok/s/req p50/p99':>19} "
          f"{'agg tok/s':>10} {'wall s':>7}")
    for name, r in results.items():
        print(f"{name:10} {r['ttft_p50']:8.2f}/{r['ttft_p99']:<9.2f} {r['itl_p50'] * 1e3:8.1f}/{r['itl_p99'] * 1e3:<9.1f} "
              f"{r['tok_s_p50']:9.1f}/{r['tok_s_p99']:<9.1f} {r['agg_tok_s']:10.1f} {r['wall']:7.1f}")
    pd = results["P/D"]
    print(f"P/D vs pd-serve: TTFT p50 x{pd['ttft_p50'] / base['ttft_p50']:.2f}, ITL p50 "
          f"x{pd['itl_p50'] / base['itl_p50']:.2f}, aggregate tok/s x{pd['agg_tok_s'] / base['agg_tok_s']:.2f}")
    print_latencies(latency)
    return 0


def print_latencies(latency: dict[str, list[float]]) -> None:
    print("\nshort requests (16 prompt tokens, 1 output token), sequential, the paths interleaved:")
    for name, values in latency.items():
        print(f"  {name:28} p50 {percentile(values, 50) * 1e3:7.2f} ms  p99 {percentile(values, 99) * 1e3:7.2f} ms")
    via, direct = latency["proxy -> decode node"], latency["decode node direct"]
    added = percentile(via, 50) - percentile(direct, 50)
    # The same statistic over pairs (request i through the proxy minus request i direct, sent back to back):
    # less moved by the engine's own time drifting over the run, a check on the difference of medians.
    paired = percentile([v - d for v, d in zip(via, direct)], 50)
    print(f"  proxy's added latency (p50): {added * 1e3:.2f} ms (bar <= 1 ms); median of paired differences "
          f"{paired * 1e3:.2f} ms")


if __name__ == "__main__":
    sys.exit(main())
