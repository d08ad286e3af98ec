"""The decode node's KV load alone, against a raw read of the very same stored objects, in one run.

What "load" means here is everything a decode node does to bring a prompt's KV in, through the
connector's real code path: `StoreConnector.start_load_kv` and `wait_for_layer_load` for every
layer (store read straight into the paged KV blocks -> header, key binding and xxh3 check there,
inside the load's write gate), with no forward pass competing for the cores. The blocks are a
shuffled set (the worst case: no two consecutive, so each object lands in one piece per block
and half), in paged KV caches of the engine's layout allocated here, so the engine's own caches
are never touched.

The raw ceiling reads the same objects (same names, same sizes, page cache warm for files) with
no check and no scatter, each into its own pre-faulted buffer kept for the whole load (a reader
that keeps the bytes), on one thread and on as many threads as the store's I/O pool, one
pipeline per layer on redis; the best of them is the ceiling. On redis that is done three ways:
with the store's Python reply reader (kvstore.resp.get_into: values straight into the buffers),
with plain redis-py pipelined GETs (values as fresh bytes objects, kept), and with the load's
own compiled receiver (kvstore/csrc/kv_recv.c: its windowed sends, no checksum, no gate, one
buffer per value), so a better way of reading redis raises the ceiling as well as the load.
Rounds alternate load and raw read, best of `repeats` each, so a load spike on a shared machine
hits both. Also printed (info, not the ceiling): a raw read into one reused buffer, which keeps
nothing and so bounds any reader from above.

With `--codecs raw int8 fp8 lossless` it times instead each codec's whole load (the same connector path,
a store written with `?codec=`) in ms, best of `repeats`, the batched coded path (kvstore/coded_reads.py)
and, with `--per-object`, also the per-object path coded loads took before it (connectors/decoded_loads.py's
DecodedLoads.read_parts), each against raw in the same run; `--model smollm2` loads a real model's KV shape
(engine/builtin_model.preset_checkpoint).

Used by benchmarks/kv_handoff.py; standalone:
    .venv/bin/python benchmarks/kv_load_only.py [--tokens 2048] [--stores file redis] [--repeats 5] [--io-threads N]
        [--codecs raw int8 fp8 lossless [--per-object]] [--model bench|smollm2]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from pdserve.connectors.chunk_math import LoadPlan, slots_for
from pdserve.connectors.chunked import ChunkedConnectorMetadata, LoadSpec
from pdserve.connectors.store_connector import StoreConnector
import numpy as np

from pdserve.kvstore import object_format, resp
from pdserve.kvstore.filesystem import FileSystemStore
from pdserve.kvstore.redis_store import RedisStore
from pdserve.kvstore.spans import SpanTable
from pdserve.serving import LLM, SamplingParams

FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


@dataclass
class LoadOnly:
    """GB/s of one prompt's load and of the raw reads of its objects (best of the repeats)."""

    nbytes: int  # payload bytes the load read (what the connector counts)
    objects: int
    load: float
    raw: float  # the ceiling: the best raw read that keeps the bytes
    raw_1: float
    raw_n: float
    raw_reused: float  # info: one reused buffer, nothing kept
    threads: int
    raw_client: float = 0.0  # redis: plain redis-py pipelines, 1 thread (0: not measured)
    raw_compiled: float = 0.0  # redis: the load's compiled receiver, no checksum, best of 1 and N threads

    @property
    def share(self) -> float:
        return self.load / self.raw


def _best(fn: Callable[[], object], best: float) -> float:
    start = time.perf_counter()
    fn()
    return min(best, time.perf_counter() - start)


def _raw_readers(store, items: list[tuple[int, str]], threads: int) -> dict[str, Callable[[], None]]:
    """Plain reads of the store's objects with no check: {name: fn}."""
    if isinstance(store, FileSystemStore):
        paths = [store.object_name(key, layer) for layer, key in items]
        bufs = [bytearray(os.path.getsize(p)) for p in paths]  # pre-faulted: bytearray zero-fills
        reused = bytearray(max(len(b) for b in bufs))

        def read(indices: range, into_reused: bool = False) -> None:
            for i in indices:
                fd = os.open(paths[i], os.O_RDONLY)
                try:
                    os.readv(fd, [reused if into_reused else bufs[i]])
                finally:
                    os.close(fd)
    elif isinstance(store, RedisStore):
        names = [store.object_name(key, layer) for layer, key in items]
        client = store._redis  # noqa: SLF001 (the store's own connection pool: same sockets, same server)
        sizes = [client.strlen(name) for name in names]
        bufs = [memoryview(bytearray(size)) for size in sizes]
        reused = memoryview(bytearray(max(sizes)))
        kept: list[object] = [None] * len(names)
        per_layer = max(1, len(items) // max(1, len({layer for layer, _ in items})))

        def read(indices: range, into_reused: bool = False) -> None:
            for lo in range(indices.start, indices.stop, per_layer):  # one pipeline per layer, like a load
                hi = min(lo + per_layer, indices.stop)
                resp.get_into(client, names[lo:hi], [[reused[:s] if into_reused else bufs[i]]
                                                     for i, s in zip(range(lo, hi), sizes[lo:hi])])

        def read_client() -> None:
            for lo in range(0, len(names), per_layer):
                pipe = client.pipeline(transaction=False)
                for name in names[lo:lo + per_layer]:
                    pipe.get(name)
                kept[lo:lo + per_layer] = pipe.execute()

        reader = store.span_reader
        if reader is not None:  # the load's own receiver (kvstore/csrc/kv_recv.c) with no checksum or gate
            payloads = [memoryview(bytearray(size - object_format.HEADER_SIZE)) for size in sizes]
            heads = np.zeros(object_format.HEADER_SIZE * len(names), np.uint8)
            packer = client.connection_pool.get_connection()
            commands = [b"".join(packer.pack_command("GET", name)) for name in names]
            client.connection_pool.release(packer)
            tables = {}
            for lo in range(0, len(names), per_layer):
                views = payloads[lo:lo + per_layer]
                desc = np.array([(j, 0, view.nbytes) for j, view in enumerate(views)], np.int64).reshape(-1, 3)
                tables[lo] = SpanTable(views, desc, np.arange(len(views) + 1, dtype=np.int64))

            def read_compiled(indices: range) -> None:
                for lo in range(indices.start, indices.stop, per_layer):
                    table, hi = tables[lo], min(lo + per_layer, indices.stop)
                    conn = client.connection_pool.get_connection()
                    try:
                        got = reader.resp_get(conn._sock.fileno(), commands[lo:hi], table.desc,  # noqa: SLF001
                                              table.first, table.bases(),
                                              heads[object_format.HEADER_SIZE * lo:], 0, 10_000, hash=False)
                        assert got.status == 0 and got.extra == 0 and (got.sizes == sizes[lo:hi]).all()
                    finally:
                        client.connection_pool.release(conn)
    else:
        raise ValueError(f"no raw reader for {type(store).__name__}")
    n = len(items)
    pool = concurrent.futures.ThreadPoolExecutor(threads)
    # whole layers per thread: the compiled reader's tables are per layer, so a bound never splits one
    layer_items = max(1, n // max(1, len({layer for layer, _ in items})))
    per_layer_items = max(1, n // threads // layer_items) * layer_items

    bounds = [range(i, min(i + per_layer_items, n)) for i in range(0, n, per_layer_items)]

    def parallel() -> None:  # whole layers per thread, as the load's I/O pool does
        list(pool.map(read, bounds))

    readers = {"raw_1": lambda: read(range(n)), "raw_n": parallel, "raw_reused": lambda: read(range(n), True)}
    if isinstance(store, RedisStore):
        readers["raw_client"] = read_client
        if store.span_reader is not None:
            readers["raw_c1"] = lambda: read_compiled(range(n))
            readers["raw_cn"] = lambda: list(pool.map(read_compiled, bounds))
    return readers


def measure(llm: LLM, url: str, tokens: int, repeats: int, seed: int) -> LoadOnly:
    """Save a fresh `tokens`-token prompt through `llm` (a producer on `url`), then time its load
    through a consumer StoreConnector of the same model against raw reads of the same objects."""
    rng = random.Random(seed)
    prompt = [rng.randrange(3, 259) for _ in range(tokens)]
    llm.generate([prompt], FIRST_TOKEN)
    engine = llm.engine
    runner = engine.model_runner
    connector = StoreConnector(engine.config, runner)
    chunk, block = connector.chunk_size, connector.block_size
    keys = connector.keys_for(prompt, None)
    hit = min(connector.store.lookup(keys) * chunk, tokens)
    plan = LoadPlan(tokens, 0, hit, chunk)
    assert plan.need_to_load == tokens - 1, f"{url}: only {hit} of {tokens} tokens are in the store"
    num_blocks = -(-tokens // block)
    block_ids = random.Random(seed).sample(range(1, 4 * num_blocks), num_blocks)
    caches = runner.platform.allocate_kv_caches(runner.num_layers, 4 * num_blocks, block, runner.num_kv_heads,
                                                runner.head_dim, runner.dtype)
    connector.register_kv_caches(caches)
    slots = slots_for(block_ids, *plan.write_range, block)
    items = [(layer, key) for layer in range(runner.num_layers) for key in keys[:len(plan.chunk_range)]]
    threads = connector.store._pool._max_workers  # noqa: SLF001 (the load's own parallelism)
    raws = _raw_readers(connector.store, items, threads)

    def load() -> None:
        spec = LoadSpec(f"load-only-{seed}", prompt, None, plan, slots)
        connector.start_load_kv(ChunkedConnectorMetadata(loads=[spec]))
        for layer in range(runner.num_layers):
            connector.wait_for_layer_load(layer)
        assert not connector.get_failed_loads(), f"{url}: the load failed"

    best = dict.fromkeys(["load", *raws], float("inf"))
    load()  # warm-up: pools, buffers, connections
    for _ in range(repeats):
        best["load"] = _best(load, best["load"])
        for name, fn in raws.items():
            best[name] = _best(fn, best[name])
    connector.shutdown()
    nbytes = plan.retrieved * runner.num_layers * 2 * runner.num_kv_heads * runner.head_dim * \
        torch.empty((), dtype=runner.dtype).element_size()
    gbps = {name: nbytes / seconds / 1e9 for name, seconds in best.items()}
    compiled = max(gbps.get("raw_c1", 0.0), gbps.get("raw_cn", 0.0))
    ceiling = max(gbps["raw_1"], gbps["raw_n"], gbps.get("raw_client", 0.0), compiled)
    return LoadOnly(nbytes, len(items), gbps["load"], ceiling, gbps["raw_1"], gbps["raw_n"], gbps["raw_reused"],
                    threads, gbps.get("raw_client", 0.0), compiled)


def _connector_load(llm: LLM, tokens: int, seed: int, per_object: bool = False) -> tuple[Callable[[], None], Any]:
    """Save a fresh prompt through producer `llm`; a consumer connector's whole load of it, as a callable."""
    rng = random.Random(seed)
    prompt = [rng.randrange(3, 259) for _ in range(tokens)]
    llm.generate([prompt], FIRST_TOKEN)
    runner = llm.engine.model_runner
    connector = StoreConnector(llm.engine.config, runner)
    if per_object:  # the path coded loads took before the batched one (object by object, staged), as on main
        connector._whole = lambda layouts: False  # noqa: SLF001
    chunk, block = connector.chunk_size, connector.block_size
    hit = min(connector.store.lookup(connector.keys_for(prompt, None)) * chunk, tokens)
    plan = LoadPlan(tokens, 0, hit, chunk)
    assert plan.need_to_load == tokens - 1, f"only {hit} of {tokens} tokens are in the store"
    num_blocks = -(-tokens // block)
    block_ids = random.Random(seed).sample(range(1, 4 * num_blocks), num_blocks)
    connector.register_kv_caches(runner.platform.allocate_kv_caches(
        runner.num_layers, 4 * num_blocks, block, runner.num_kv_heads, runner.head_dim, runner.dtype))
    slots = slots_for(block_ids, *plan.write_range, block)

    def load() -> None:
        spec = LoadSpec(f"load-only-{seed}", prompt, None, plan, slots)
        connector.start_load_kv(ChunkedConnectorMetadata(loads=[spec]))
        for layer in range(runner.num_layers):
            connector.wait_for_layer_load(layer)
        assert not connector.get_failed_loads(), "the load failed"

    return load, connector


def measure_codecs(model: Path, url: str, tokens: int, codecs: list[str], repeats: int, per_object: bool,
                   seed: int) -> dict[str, float]:
    """ms of each codec's whole load ("<codec>/per-object" too with per_object), rounds alternating."""
    loads, connectors, llms = {}, [], []
    for i, name in enumerate(codecs):
        coded = f"{url}{'&' if '?' in url else '?'}codec={name}"
        llm = LLM(str(model), kv_store=coded, kv_role="kv_producer", kv_cache_memory="1GiB")
        llms.append(llm)
        for slow in ([False, True] if per_object and name != "raw" else [False]):
            load, connector = _connector_load(llm, tokens, seed + 100 * i, per_object=slow)
            loads[f"{name}/per-object" if slow else name] = load
            connectors.append(connector)
    best = dict.fromkeys(loads, float("inf"))
    for load in loads.values():
        load()  # warm-up
    for _ in range(repeats):
        for name, load in loads.items():
            best[name] = _best(load, best[name])
    for connector in connectors:
        connector.shutdown()
    for llm in llms:
        llm.engine.shutdown()
    return {name: 1e3 * seconds for name, seconds in best.items()}


def codec_table(results: dict[str, dict[str, float]], tokens: int) -> list[str]:
    lines = [f"whole load of a {tokens}-token prompt through the connector (ms, best of the repeats; x raw)",
             f"{'store':>6} {'codec':>20} {'ms':>8} {'x raw':>6}"]
    for store, times in results.items():
        raw = times.get("raw")
        for name, ms in times.items():
            lines.append(f"{store:>6} {name:>20} {ms:8.1f} {ms / raw if raw else float('nan'):6.2f}")
    return lines


def table(results: dict[str, LoadOnly], tokens: int) -> list[str]:
    lines = [f"load only, {tokens}-token prompt, no forward pass competing (GB/s of KV payload; raw = the same "
             f"objects read with no check or scatter into kept pre-faulted buffers; ceiling = the best raw column)",
             f"{'store':>6} {'MB':>5} {'objects':>7} {'load':>6} {'raw 1 thr':>9} {'raw N thr':>9} "
             f"{'raw redis-py':>12} {'raw C recv':>10} {'load/ceiling':>12} {'(info) raw into 1 reused buf':>29}"]
    for name, r in results.items():
        client = f"{r.raw_client:12.2f}" if r.raw_client else f"{'-':>12}"
        compiled = f"{r.raw_compiled:10.2f}" if r.raw_compiled else f"{'-':>10}"
        lines.append(f"{name:>6} {r.nbytes / 1e6:5.1f} {r.objects:7d} {r.load:6.2f} {r.raw_1:9.2f} "
                     f"{r.raw_n:7.2f}/{r.threads} {client} {compiled} {100 * r.share:11.0f}% {r.raw_reused:29.2f}")
    return lines


def main() -> int:
    from engine_throughput import bench_model_path
    from kv_handoff import backend

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--stores", nargs="+", default=["file", "redis"], choices=["file", "redis"])
    parser.add_argument("--io-threads", type=int, default=None,
                        help="the store's I/O threads (its io_threads option; default: the store's own)")
    parser.add_argument("--codecs", nargs="+", choices=["raw", "lossless", "int8", "fp8"],
                        help="time each codec's whole load against raw instead of the load-vs-ceiling table")
    parser.add_argument("--per-object", action="store_true", help="with --codecs: the per-object coded path too")
    parser.add_argument("--model", default="bench", help="bench (the benchmarks' model) or a preset (smollm2)")
    args = parser.parse_args()
    if args.model == "bench":
        model = bench_model_path()
    else:
        from pdserve.engine.builtin_model import preset_checkpoint
        model = preset_checkpoint(args.model)[0]
    tmp = Path(tempfile.mkdtemp(prefix="kv-load-only-"))
    results = {}
    try:
        for i, name in enumerate(args.stores):
            with backend(name, tmp) as url:
                if args.io_threads:
                    url = f"{url}{'&' if '?' in url else '?'}io_threads={args.io_threads}"
                if args.codecs:
                    results[name] = measure_codecs(model, url, args.tokens, args.codecs, args.repeats,
                                                   args.per_object, seed=11 + i)
                    continue
                llm = LLM(str(model), kv_store=url, kv_role="kv_producer", kv_cache_memory="1GiB")
                results[name] = measure(llm, url, args.tokens, args.repeats, seed=11 + i)
                llm.engine.shutdown()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("\n".join(codec_table(results, args.tokens) if args.codecs else table(results, args.tokens)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
