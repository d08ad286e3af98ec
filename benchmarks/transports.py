"""Hand-written protocol code against the library path it would leave, on the real model, in one run.

The decode connector's whole load of a 2k- and an 8k-token prompt's KV from redis (StoreConnector's
real path: every layer into shuffled paged blocks of SmolLM2-135M-Instruct's layout, each object
checked) through each receive path of kvstore/redis_store.py:

  compiled  kvstore/csrc/kv_recv.c through kvstore.resp.get_table (where it builds: the default)
  python    kvstore.resp.get_into, pdserve's own RESP reader (without a C compiler, and on TLS)
  redis-py  redis-py's pipelined GETs, parsed by hiredis when it is installed, each value copied in and
            checked (kvstore.base.KVStore's path, which RedisClusterStore takes)

The paths take turns (rounds rotate their order, so a noisy neighbour on a shared machine hits each
alike); each is reported as ms of the whole load, best and median over the rounds, and as redis-py's
median over its own. The decode stream's second transport (an HTTP frame stream beside gRPC
streaming) was compared here too, on a SmolLM2 P/D cluster with two proxies over the same nodes (ITL,
TTFT and tokens/s at concurrency 1, 8 and 32, and one-token requests); it did not pay and was removed
with that part of this script (its last version: `git show ae93638:benchmarks/transports.py`; the
figures are in docs/benchmarks.md).

    .venv/bin/python benchmarks/transports.py [--kv-tokens 2048 8000] [--kv-rounds 9] [--json PATH]
    .venv/bin/python benchmarks/transports.py --quick     # a smoke run: small, one round
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import time
from pathlib import Path
from types import MethodType
from typing import Any, Callable

from machine import describe


def summarize(values: list[float], better: Callable[[list[float]], float]) -> tuple[float, float]:
    """(best, median) of one figure over the rounds."""
    return better(values), statistics.median(values)


# -------------------------------------------------------------------------------------------------- kv
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
    from pdserve.deploy.redis_servers import RedisServer
    from pdserve.engine.real_model import real_model_path
    from pdserve.serving import LLM, SamplingParams

    print(f"redis-py {redis.__version__}, hiredis parser: {redis.utils.HIREDIS_AVAILABLE}", flush=True)
    server = RedisServer("--maxmemory", "2gb", "--maxmemory-policy", "allkeys-lru")
    server.start()
    results: dict[int, dict[str, list[float]]] = {}
    try:
        url = server.url
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
        server.stop()
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
    p.add_argument("--kv-tokens", type=int, nargs="+", default=[2048, 8000])
    p.add_argument("--kv-rounds", type=int, default=9)
    p.add_argument("--json", default=None, metavar="PATH", help="also write every round's figures here")
    p.add_argument("--quick", action="store_true", help="a smoke run: small, one round")
    args = p.parse_args()
    if args.quick:
        args.kv_tokens, args.kv_rounds = [512], 1
    print(describe(), flush=True)
    raw: dict[str, Any] = {"machine": describe(), "args": vars(args)}
    try:
        raw["kv"] = bench_kv(args)
    finally:
        if args.json:
            Path(args.json).write_text(json.dumps(raw, indent=1))
    print("\n" + describe() + "\n" + "\n".join(kv_table(raw["kv"], args.kv_rounds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
