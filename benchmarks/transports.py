"""Hand-written protocol code against the library path it would leave, on the real model, in one run.

Two comparisons, each between variants that take turns (rounds alternate their order, so a noisy
neighbour on a shared machine hits every variant alike); each figure is reported as the best and
the median over the rounds, and as a ratio against the library path:

  stream  a P/D cluster of SmolLM2-135M-Instruct (one prefill node, one decode node, file store) with
          two proxies over the same nodes: one sends Generate to the decode node's HTTP port as a frame
          stream (`pd-proxy --decode-transport auto`: proxy/http_generate.py, proxy/frame_client.py,
          serving/node_http.py, serving/delta_frames.py), the other over gRPC streaming
          (`--decode-transport grpc`). Closed loop at each concurrency c: c clients send streaming
          completions back to back (random-token prompts, fresh per round and per proxy, EOS ignored);
          per level: inter-token latency p50/p99 over every gap, TTFT p50, output tokens/s (tokens of
          the level / its wall time). Timed by pd-bench's client (pdserve.bench.client.send). Also, each
          round: one-token requests sent one at a time, taking turns between the proxies (the per-request
          cost the HTTP transport was written to cut), p50.
  kv      the decode connector's whole load of a 2k- and an 8k-token prompt's KV (StoreConnector's real
          path: every layer from redis into shuffled paged blocks, each object checked) through each
          receive path of kvstore/redis_store.py: `compiled` (kvstore/csrc/kv_recv.c, through
          kvstore.resp.get_table), `python` (kvstore.resp.get_into, pdserve's own RESP reader: the path
          without a C compiler, and on TLS) and `redis-py` (redis-py pipelined GETs,
          parsed by hiredis when it is installed, then copied and checked: kvstore.base.KVStore's path,
          which RedisClusterStore takes).

    .venv/bin/python benchmarks/transports.py [--parts stream kv] [--rounds 5] [--concurrency 1 8 32]
        [--prompt-len 64] [--output-len 128] [--requests-per-client 2] [--kv-tokens 2048 8000]
        [--latency-probes 40] [--kv-rounds 9] [--json PATH]
    .venv/bin/python benchmarks/transports.py --quick     # a smoke run: small, one round
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import MethodType
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pdserve, installed or not

SERVED_NAME = "bench-model"
STREAM_VARIANTS = {"http": "auto", "grpc": "grpc"}  # name -> pd-proxy --decode-transport


def machine() -> str:
    """The machine line every figure is quoted with: lscpu's model name, cores, bf16 matmul support."""
    model, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    bf16 = [f for f in ("avx512_bf16", "amx_bf16", "amx_tile") if f in flags] or ["no native bf16 flags"]
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"machine: {model}, {os.cpu_count()} CPUs, {' '.join(bf16)}; load average {load}"


def summarize(values: list[float], better: Callable[[list[float]], float]) -> tuple[float, float]:
    """(best, median) of one figure over the rounds."""
    return better(values), statistics.median(values)


# ---------------------------------------------------------------------------------------------- stream
@dataclass
class Level:
    """One variant at one concurrency in one round."""

    itl_p50: float
    itl_p99: float
    ttft_p50: float
    tok_s: float


def _random_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


async def _run_level(url: str, concurrency: int, per_client: int, prompt_len: int, output_len: int,
                     seed: int) -> Level:
    import aiohttp

    from pdserve.bench.client import RequestOptions, send
    from pdserve.bench.workloads import Session, Turn

    opts = RequestOptions(api="completions", model=SERVED_NAME, ignore_eos=True)
    prompts = _random_prompts(concurrency * per_client, prompt_len, seed)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as http:
        start = time.perf_counter()

        async def client(k: int) -> list[Any]:
            out = []
            for i in range(per_client):
                turn = Turn(max_tokens=output_len, token_ids=prompts[k * per_client + i])
                out.append(await send(http, url + "/v1", Session(f"c{k}", [turn]), turn, opts, start))
            return out

        records = [r for rs in await asyncio.gather(*(client(k) for k in range(concurrency))) for r in rs]
        wall = time.perf_counter() - start
    failed = [r for r in records if not r.ok or r.output_tokens != output_len]
    if failed:
        raise RuntimeError(f"{len(failed)} request(s) failed at {url}, e.g. {failed[0].error or failed[0]}")
    gaps = np.array([g for r in records for g in r.itl]) * 1e3
    return Level(float(np.percentile(gaps, 50)), float(np.percentile(gaps, 99)),
                 float(np.percentile([r.ttft * 1e3 for r in records], 50)),
                 sum(r.output_tokens for r in records) / wall)


async def _one_token_latencies(urls: dict[str, str], n: int, seed: int) -> dict[str, list[float]]:
    """ms of n one-token requests per proxy (Prefill, then a Generate that only carries the prefill node's
    token: the per-request cost the HTTP transport was written to cut), taking turns request by request."""
    import aiohttp

    out: dict[str, list[float]] = {name: [] for name in urls}
    async with aiohttp.ClientSession() as http:
        for i, prompt in enumerate(_random_prompts(n * len(urls), 16, seed)):
            name, url = list(urls.items())[i % len(urls)]
            body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0}
            start = time.perf_counter()
            async with http.post(url + "/v1/completions", json=body) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"{resp.status}: {(await resp.text())[:300]}")
                await resp.read()
            out[name].append((time.perf_counter() - start) * 1e3)
    return out


def _status(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url + "/status", timeout=2) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


def _wait_transport(url: str, want: str, timeout_s: float = 120.0) -> str:
    """Until the proxy at `url` has its decode node healthy and on the transport `want` (http | grpc)."""
    deadline = time.monotonic() + timeout_s
    over = None
    while time.monotonic() < deadline:
        status = _status(url)
        if status and status["decode"] and all(n["healthy"] for n in status["decode"] + status["prefill"]):
            over = status["decode"][0]["generate_over"]
            if (over == "grpc") == (want == "grpc"):
                return over
        time.sleep(0.3)
    raise RuntimeError(f"the proxy at {url} does not decode over {want} (generate_over: {over})")


def bench_stream(args: argparse.Namespace, log_dir: Path) -> tuple[dict[str, dict[int, list[Level]]],
                                                                   dict[str, list[float]]]:
    from pdserve.deploy.processes import (HOST, Child, ClusterSpec, LocalCluster, free_port, python_module)
    from pdserve.engine.real_model import real_model_path

    model = str(real_model_path("smollm2"))
    node_args = ["--served-model-name", SERVED_NAME, "--kv-cache-memory", "1GiB"]
    cluster = LocalCluster(ClusterSpec(model=model, log_dir=log_dir / "cluster", node_args=node_args,
                                       proxy_args=["--decode-transport", STREAM_VARIANTS["http"]]))
    cluster.start(timeout_s=600)
    port = free_port()
    second = Child("proxy-grpc", python_module(
        "pdserve.proxy", "--host", HOST, "--port", str(port),
        "--prefill", ",".join(n.grpc_address for n in cluster.prefill),
        "--decode", ",".join(n.grpc_address for n in cluster.decode),
        "--decode-transport", STREAM_VARIANTS["grpc"]), cluster.spec.log_dir, ports=[port])
    urls = {"http": cluster.url, "grpc": f"http://{HOST}:{port}"}
    results: dict[str, dict[int, list[Level]]] = {v: {c: [] for c in args.concurrency} for v in urls}
    one_token: dict[str, list[float]] = {v: [] for v in urls}  # p50 ms per round
    try:
        second.start()
        for name, url in urls.items():
            print(f"{name:>5} proxy {url}: Generate over {_wait_transport(url, name)}", flush=True)
        run = lambda url, c, seed: asyncio.run(_run_level(  # noqa: E731
            url, c, args.requests_per_client, args.prompt_len, args.output_len, seed))
        for c in args.concurrency:  # warm-up: each shape once per proxy, not counted
            for name, url in urls.items():
                run(url, c, seed=90_000 + 10 * c + (name == "grpc"))
        for r in range(args.rounds):
            for c in args.concurrency:
                order = list(urls) if (r + c) % 2 == 0 else list(urls)[::-1]
                for name in order:
                    level = run(urls[name], c, seed=1000 * (r + 1) + 10 * c + (name == "grpc"))
                    results[name][c].append(level)
                    print(f"round {r + 1} c={c:<3} {name:>5}: ITL p50 {level.itl_p50:6.2f} p99 {level.itl_p99:7.2f} ms, "
                          f"TTFT p50 {level.ttft_p50:7.1f} ms, {level.tok_s:7.1f} tok/s", flush=True)
            if args.latency_probes:
                order = list(urls) if r % 2 == 0 else list(urls)[::-1]
                got = asyncio.run(_one_token_latencies({n: urls[n] for n in order}, args.latency_probes, 7000 + r))
                for name, values in got.items():
                    one_token[name].append(statistics.median(values))
                print(f"round {r + 1} one-token requests, p50: " +
                      ", ".join(f"{n} {one_token[n][-1]:.2f} ms" for n in urls), flush=True)
    finally:
        second.stop()
        cluster.stop()
    return results, one_token


def stream_table(results: dict[str, dict[int, list[Level]]], one_token: dict[str, list[float]],
                 args: argparse.Namespace) -> list[str]:
    rounds = len(next(iter(next(iter(results.values())).values())))
    lines = [f"decode stream, SmolLM2-135M-Instruct P/D ({args.prompt_len}-token prompts, {args.output_len} output "
             f"tokens, {args.requests_per_client} per client); best / median of {rounds} interleaved rounds",
             "| c | figure | HTTP frames (best / median) | gRPC (best / median) | HTTP vs gRPC (median) |",
             "|---|---|---|---|---|"]
    figures = [("ITL p50 (ms)", "itl_p50", min), ("ITL p99 (ms)", "itl_p99", min),
               ("TTFT p50 (ms)", "ttft_p50", min), ("output tok/s", "tok_s", max)]
    for c in results["http"]:
        for label, attr, better in figures:
            h = summarize([getattr(x, attr) for x in results["http"][c]], better)
            g = summarize([getattr(x, attr) for x in results["grpc"][c]], better)
            # > 1: HTTP is better (lower latency, or more tokens per second)
            gain = g[1] / h[1] if better is min else h[1] / g[1]
            lines.append(f"| {c} | {label} | {h[0]:.2f} / {h[1]:.2f} | {g[0]:.2f} / {g[1]:.2f} | "
                         f"{gain:.3f}x {'better' if gain >= 1 else 'worse'} |")
    if one_token["http"]:
        h, g = summarize(one_token["http"], min), summarize(one_token["grpc"], min)
        lines.append(f"| 1 | one-token request, p50 of {args.latency_probes} per round (ms) | {h[0]:.2f} / {h[1]:.2f} | "
                     f"{g[0]:.2f} / {g[1]:.2f} | {g[1] / h[1]:.3f}x ({g[1] - h[1]:+.2f} ms over gRPC) |")
    return lines


# -------------------------------------------------------------------------------------------------- kv
def _redis_server(port: int) -> subprocess.Popen:
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
    return subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--maxmemory", "2gb", "--maxmemory-policy", "allkeys-lru"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def use_path(store: Any, path: str, reader: Any) -> None:
    """Point a RedisStore's loads at one receive path (instance attributes over its methods)."""
    from pdserve.kvstore.base import KVStore

    store.span_reader = reader if path == "compiled" else None
    for name in ("_get_spans", "_get_table"):
        store.__dict__.pop(name, None)
        if path == "redis-py":
            setattr(store, name, MethodType(getattr(KVStore, name), store))


def bench_kv(args: argparse.Namespace) -> dict[int, dict[str, list[float]]]:
    import redis
    import torch

    from pdserve.connectors.chunk_math import LoadPlan, slots_for
    from pdserve.connectors.chunked import ChunkedConnectorMetadata, LoadSpec
    from pdserve.connectors.store_connector import StoreConnector
    from pdserve.deploy.processes import free_port, wait_for_port
    from pdserve.engine.real_model import real_model_path
    from pdserve.serving import LLM, SamplingParams

    print(f"redis-py {redis.__version__}, hiredis parser: {redis.utils.HIREDIS_AVAILABLE}", flush=True)
    port = free_port()
    server = _redis_server(port)
    results: dict[int, dict[str, list[float]]] = {}
    try:
        if not wait_for_port(port, 30.0):
            raise RuntimeError("redis-server did not start")
        url = f"redis://127.0.0.1:{port}/0"
        llm = LLM(str(real_model_path("smollm2")), kv_store=url, kv_role="kv_producer", kv_cache_memory="1GiB")
        runner = llm.engine.model_runner
        connector = StoreConnector(llm.engine.config, runner)
        store, block = connector.store, connector.block_size
        reader = store.span_reader
        if reader is None:
            raise RuntimeError("no compiled receiver here (no C compiler, or PDSERVE_KERNELS=torch)")
        most = -(-max(args.kv_tokens) // block)
        connector.register_kv_caches(runner.platform.allocate_kv_caches(
            runner.num_layers, 2 * most + 1, block, runner.num_kv_heads, runner.head_dim, runner.dtype))
        variants = ["compiled", "python", "redis-py"]
        ids = itertools.count()  # one request id per load: the connector keeps per-request state
        for t, tokens in enumerate(args.kv_tokens):
            prompt = [random.Random(tokens).randrange(100, 40000) for _ in range(tokens)]
            llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
            hit = min(store.lookup(connector.keys_for(prompt, None)) * connector.chunk_size, tokens)
            plan = LoadPlan(tokens, 0, hit, connector.chunk_size)
            assert plan.need_to_load >= tokens - 1, f"only {hit} of {tokens} tokens are in the store"
            blocks = random.Random(t).sample(range(1, 2 * most + 1), -(-tokens // block))
            slots = slots_for(blocks, *plan.write_range, block)
            mb = plan.retrieved * runner.num_layers * 2 * runner.num_kv_heads * runner.head_dim * \
                torch.empty((), dtype=runner.dtype).element_size() / 1e6

            def load(path: str) -> float:
                use_path(store, path, reader)
                start = time.perf_counter()
                connector.start_load_kv(ChunkedConnectorMetadata(loads=[LoadSpec(f"kv-{tokens}-{path}-{next(ids)}", prompt, None, plan,
                                                                                  slots)]))
                for layer in range(runner.num_layers):
                    connector.wait_for_layer_load(layer)
                seconds = time.perf_counter() - start
                assert not connector.get_failed_loads(), f"the {path} load failed"
                return seconds * 1e3

            for path in variants:  # warm-up: connections, buffers
                load(path)
            times: dict[str, list[float]] = {path: [] for path in variants}
            for r in range(args.kv_rounds):
                k = r % len(variants)
                for path in variants[k:] + variants[:k]:
                    times[path].append(load(path))
            results[tokens] = times
            print(f"{tokens} tokens ({mb:.0f} MB of KV, {runner.num_layers} layers): " +
                  ", ".join(f"{p} {min(v):.1f} ms" for p, v in times.items()), flush=True)
        use_path(store, "compiled", reader)
        connector.shutdown()
        llm.engine.shutdown()
    finally:
        server.terminate()
        server.wait(timeout=10)
    return results


def kv_table(results: dict[int, dict[str, list[float]]], rounds: int) -> list[str]:
    names = {"compiled": "compiled receiver (kv_recv.c)", "python": "pdserve's RESP reader (resp.get_into)",
             "redis-py": "redis-py + hiredis"}
    lines = [f"KV load from redis through the decode connector, SmolLM2-135M-Instruct; ms of the whole load, best / "
             f"median of {rounds} interleaved rounds",
             "| tokens | receive path | best ms | median ms | redis-py time / this (median) |",
             "|---|---|---|---|---|"]
    for tokens, times in results.items():
        base = statistics.median(times["redis-py"])
        for path, values in times.items():
            best, median = summarize(values, min)
            lines.append(f"| {tokens} | {names[path]} | {best:.1f} | {median:.1f} | {base / median:.2f}x |")
    return lines


# -------------------------------------------------------------------------------------------------- main
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", nargs="+", choices=("stream", "kv"), default=["stream", "kv"])
    p.add_argument("--rounds", type=int, default=5, help="stream rounds (each runs every level on both proxies)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--latency-probes", type=int, default=40,
                   help="one-token requests per proxy and round, sent one at a time (0: none)")
    p.add_argument("--kv-tokens", type=int, nargs="+", default=[2048, 8000])
    p.add_argument("--kv-rounds", type=int, default=9)
    p.add_argument("--json", default=None, metavar="PATH", help="also write every round's figures here")
    p.add_argument("--quick", action="store_true", help="a smoke run: one small round of each part")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.concurrency, args.prompt_len, args.output_len = 1, [1, 4], 16, 8
        args.requests_per_client, args.kv_tokens, args.kv_rounds, args.latency_probes = 1, [512], 1, 4
    print(machine(), flush=True)
    out: list[str] = []
    raw: dict[str, Any] = {"machine": machine(), "args": vars(args)}
    tmp = Path(tempfile.mkdtemp(prefix="pd-transports-"))
    try:
        if "stream" in args.parts:
            stream, one_token = bench_stream(args, tmp)
            raw["stream"] = {v: {c: [vars(x) for x in levels] for c, levels in by_c.items()} for v, by_c in stream.items()}
            raw["one_token_p50_ms"] = one_token
            out += stream_table(stream, one_token, args) + [""]
            print("\n".join(out), flush=True)
        if "kv" in args.parts:
            raw["kv"] = bench_kv(args)
            out += kv_table(raw["kv"], args.kv_rounds)
    finally:
        if args.json:
            Path(args.json).write_text(json.dumps(raw, indent=1))
        shutil.rmtree(tmp, ignore_errors=True)
    print("\n" + machine() + "\n" + "\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
