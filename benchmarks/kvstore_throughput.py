"""KV store put/get throughput per backend next to the raw ceiling of the same medium, in one run.

A realistic chunk: 256 tokens x 8 kv heads x 128 head dim, bf16, 32 layers (1 MiB per layer
object, 32 MiB per chunk). Each backend moves the same bytes as its ceiling:
  file     store put_layer/commit/get_layer  vs  plain file write / read (page cache) of the same bytes
  redis    store put_layer/commit/get_layer  vs  plain pipelined SET / GET of same-size values (redis-py)
  cluster  the redis rows on a private 3-master Redis Cluster (redis+cluster://) vs plain cluster
           pipelines (redis-py RedisCluster) of the same values, one hash slot per chunk like the store's
"get" returns fresh tensors (its ceiling: f.read() keeping a layer's buffers alive, as a
caller does). "get->out" (informational) reads into reused staging tensors against readinto
into reused buffers with no checksum: at page-cache speed the xxh3 pass over each object costs
about half as much as the copy itself, so that ratio sits near 50% by construction. "get batched"
(informational) reads every layer of the batch in one get_layers call (redis: one pipeline).
The bar: each backend reaches at least 50% of its raw ceiling. Best of --repeats runs.

    .venv/bin/python benchmarks/kvstore_throughput.py [--redis-url redis://host:port/0] [--dir PATH]
        [--cluster-url redis+cluster://host:port,...]
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import redis
import torch

from pdserve.common.hashing import chunk_keys
from pdserve.kvstore import KVStore, open_store
from pdserve.deploy.redis_servers import RedisClusterServer
from pdserve.deploy.processes import free_port, require_port

FP = "5eed" * 8
TOKENS, HEADS, HEAD_DIM, LAYERS, DTYPE = 256, 8, 128, 32, torch.bfloat16


def best_gbps(ops: dict[str, tuple[Callable[[], None], Callable[[], None]]], nbytes: int, repeats: int
              ) -> dict[str, float]:
    """{name: GB/s} for {name: (fn, setup)}, best of `repeats`; rounds interleave the ops so a
    load spike on a shared machine hits a store op and its ceiling alike."""
    best = dict.fromkeys(ops, float("inf"))
    for _ in range(repeats):
        for name, (fn, setup) in ops.items():
            setup()
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: nbytes / seconds / 1e9 for name, seconds in best.items()}


def nothing() -> None:
    """No setup needed."""


def store_ops(store: KVStore, keys: list[str], layers: list[dict[str, torch.Tensor]]):
    def put() -> None:
        for i, chunks in enumerate(layers):
            store.put_layer(i, chunks)
        store.commit(keys)

    def get() -> None:
        for i in range(LAYERS):
            store.get_layer(i, keys)

    def get_batched() -> None:
        store.get_layers(range(LAYERS), keys)

    staging = [torch.empty(2, TOKENS, HEADS, HEAD_DIM, dtype=DTYPE) for _ in keys]  # reused every layer

    def get_into() -> None:
        for i in range(LAYERS):
            store.get_layer(i, keys, out=staging)
    return put, get, get_into, get_batched


def bench_file(root: Path, keys, layers, values, nbytes, repeats) -> dict[str, float]:
    store = open_store(f"file://{root}/store", fingerprint=FP, num_layers=LAYERS, dtype=DTYPE,
                       kv_shape=(HEADS, HEAD_DIM))
    put, get, get_into, get_batched = store_ops(store, keys, layers)
    raw_dir = root / "raw"
    raw_paths = [[raw_dir / f"{k}.{i}" for k in keys] for i in range(LAYERS)]
    staging = [bytearray(len(values[0])) for _ in keys]

    def raw_put() -> None:
        for path, value in zip(sum(raw_paths, []), values):
            with open(path, "wb") as f:
                f.write(value)

    def raw_get() -> None:  # like get_layer: fresh buffers, a layer's worth alive at a time
        for paths in raw_paths:
            layer = []
            for path in paths:
                with open(path, "rb") as f:
                    layer.append(f.read())

    def raw_get_into() -> None:
        for paths in raw_paths:
            for path, buf in zip(paths, staging):
                with open(path, "rb", buffering=0) as f:
                    f.readinto(buf)

    out = best_gbps({"put": (put, store.clear),
                     "raw put": (raw_put, lambda: (shutil.rmtree(raw_dir, True), raw_dir.mkdir()))}, nbytes, repeats)
    out.update(best_gbps({"get": (get, nothing), "raw get": (raw_get, nothing), "get->out": (get_into, nothing),
                          "raw get->out": (raw_get_into, nothing), "get batched": (get_batched, nothing)},
                         nbytes, repeats))
    out["raw get batched"] = out["raw get"]
    store.close()
    return out


def bench_redis(url: str, keys, layers, values, nbytes, repeats) -> dict[str, float]:
    """redis:// or redis+cluster:// (the raw client is then redis-py's RedisCluster)."""
    store = open_store(url, fingerprint=FP, num_layers=LAYERS, dtype=DTYPE, kv_shape=(HEADS, HEAD_DIM), timeout=30)
    put, get, get_into, get_batched = store_ops(store, keys, layers)
    if "+cluster" in url:
        from pdserve.kvstore.redis_cluster import parse_nodes

        nodes, _ = parse_nodes(url)
        client = redis.RedisCluster(startup_nodes=[redis.cluster.ClusterNode(h, p) for h, p in nodes],
                                    socket_timeout=30)
    else:
        client = redis.Redis.from_url(url, socket_timeout=30)
    raw_names = [[f"raw:{{{k}}}:{i}" for k in keys] for i in range(LAYERS)]  # a chunk's values share a slot
    per_layer = len(keys)

    def raw_put() -> None:
        for i, names in enumerate(raw_names):
            pipe = client.pipeline(transaction=False)
            for name, value in zip(names, values[i * per_layer:(i + 1) * per_layer]):
                pipe.set(name, value)
            pipe.execute()

    def raw_get() -> None:
        for names in raw_names:
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.get(name)
            pipe.execute()

    out = best_gbps({"put": (put, store.clear), "raw put": (raw_put, lambda: client.delete(*sum(raw_names, [])))},
                    nbytes, repeats)
    def raw_get_batched() -> None:
        pipe = client.pipeline(transaction=False)
        for name in sum(raw_names, []):
            pipe.get(name)
        pipe.execute()

    out.update(best_gbps({"get": (get, nothing), "raw get": (raw_get, nothing), "get->out": (get_into, nothing),
                          "get batched": (get_batched, nothing), "raw get batched": (raw_get_batched, nothing)},
                         nbytes, repeats))
    out["raw get->out"] = out["raw get"]  # redis-py has no read-into: a plain GET is the ceiling
    store.clear()
    client.delete(*sum(raw_names, []))
    store.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=4, help="chunks per put/get batch (32 MiB each)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--redis-url", help="default: start a private redis-server on a free port")
    parser.add_argument("--dir", help="directory for the file store (default: a temp dir)")
    parser.add_argument("--cluster-url", help="default: start a private 3-master Redis Cluster")
    args = parser.parse_args()

    keys = chunk_keys(FP, list(range(TOKENS * args.chunks)), TOKENS)
    gen = torch.Generator().manual_seed(0)
    layers = [{k: torch.randn(2, TOKENS, HEADS, HEAD_DIM, generator=gen).to(DTYPE) for k in keys}
              for _ in range(LAYERS)]
    nbytes = sum(t.numel() * t.element_size() for chunks in layers for t in chunks.values())
    values = [os.urandom(64 + t.numel() * t.element_size()) for chunks in layers for t in chunks.values()]
    print(f"chunk: {TOKENS} tokens x {HEADS} kv heads x {HEAD_DIM} dim, {DTYPE}, {LAYERS} layers "
          f"({nbytes / args.chunks / 2**20:.0f} MiB); batch: {args.chunks} chunks; best of {args.repeats}")

    root = Path(args.dir or tempfile.mkdtemp(prefix="kvbench-"))
    root.mkdir(parents=True, exist_ok=True)
    server = None
    url = args.redis_url
    if url is None:
        port = free_port()
        server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                   "--appendonly", "no"], stdout=subprocess.DEVNULL)
        require_port(port)
        url = f"redis://127.0.0.1:{port}/0"
    cluster = None
    cluster_url = args.cluster_url
    if cluster_url is None:
        cluster = RedisClusterServer(masters=3)
        cluster.start()
        cluster_url = cluster.url
    try:
        results = {"file": bench_file(root, keys, layers, values, nbytes, args.repeats),
                   "redis": bench_redis(url, keys, layers, values, nbytes, args.repeats),
                   "cluster": bench_redis(cluster_url, keys, layers, values, nbytes, args.repeats)}
    finally:
        if server is not None:
            server.terminate()
            server.wait()
        if cluster is not None:
            cluster.stop()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)

    ok = True
    print(f"{'backend':8} {'op':11} {'store GB/s':>11} {'raw GB/s':>9} {'ratio':>6}")
    for backend, r in results.items():
        for op in ("put", "get", "get->out", "get batched"):
            ratio = r[op] / r[f"raw {op}"]
            info = op in ("get->out", "get batched")
            ok &= info or ratio >= 0.5
            print(f"{backend:8} {op:11} {r[op]:11.2f} {r[f'raw {op}']:9.2f} {ratio:6.0%}"
                  + ("  (info)" if info else ""))
    print("bar (put and get >= 50% of raw):", "met" if ok else "NOT met")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
