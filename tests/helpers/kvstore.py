"""Helpers for the kvstore tests: deterministic chunks, store factories, a writer process, and a store
connector of one rank's KVShard without an engine (`shard_connector`).

Run as `python -m tests.helpers.kvstore URL FINGERPRINT NUM_LAYERS ROUNDS [STOP_AFTER_LAYER]
[--seed N --tokens T]` to write the standard chunks (make_chunks(T, NUM_LAYERS, seed=N)) from a
separate process: it prints "ready" once started, waits for a line on stdin (so several writers
start together), then writes ROUNDS times over, committing each round; with STOP_AFTER_LAYER it
writes layers [0, STOP_AFTER_LAYER), prints "stopped" and waits to be killed.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pdserve.common.hashing import chunk_keys
from pdserve.connectors.store_connector import StoreConnector
from pdserve.engine.config import EngineConfig
from pdserve.engine.device import Platform
from pdserve.kvstore import KVStore, open_store
from pdserve.kvstore.layout import KVShard

FP = "0123456789abcdef" * 2
OTHER_FP = "fedcba9876543210" * 2
CHUNK = 16
KV_SHAPE = (2, 8)
PYTHON = sys.executable


def make_chunks(num_tokens: int, num_layers: int, dtype: torch.dtype = torch.float32, seed: int = 0,
                fingerprint: str = FP) -> tuple[list[str], list[dict[str, torch.Tensor]]]:
    """Keys of a prompt of num_tokens tokens and, per layer, {key: [2, n, H, D]} (last chunk partial)."""
    tokens = list(range(seed * 1000, seed * 1000 + num_tokens))
    keys = chunk_keys(fingerprint, tokens, CHUNK)
    gen = torch.Generator().manual_seed(seed)
    sizes = [min(CHUNK, num_tokens - i * CHUNK) for i in range(len(keys))]
    layers = [{key: torch.randn(2, n, *KV_SHAPE, generator=gen).to(dtype) for key, n in zip(keys, sizes)}
              for _ in range(num_layers)]
    return keys, layers


def write_all(store: KVStore, keys: list[str], layers: list[dict[str, torch.Tensor]]) -> None:
    for i, chunks in enumerate(layers):
        store.put_layer(i, chunks)
    store.commit(keys)


def open_test_store(url: str, num_layers: int, dtype: torch.dtype = torch.float32, fingerprint: str = FP,
                    timeout: float = 2.0, **options) -> KVStore:
    return open_store(url, fingerprint=fingerprint, num_layers=num_layers, dtype=dtype, kv_shape=KV_SHAPE,
                      timeout=timeout, **options)


@dataclass
class ShardRunner:
    """What a StoreConnector reads of a model runner: one rank's KVShard of a float32 model."""

    kv_shard: KVShard
    fingerprint: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    platform: Platform = field(default_factory=lambda: Platform(torch.device("cpu")))


def shard_connector(url: str, shard: KVShard, *, fingerprint: str, num_layers: int, num_kv_heads: int,
                    head_dim: int, chunk_size: int, block_size: int) -> StoreConnector:
    """The store connector of rank `shard` (KVShard.tp_pp, or KVShard() for one process) on `url`."""
    config = EngineConfig.from_kwargs("unused", kv_store=url, chunk_size=chunk_size, block_size=block_size,
                                      load_timeout_s=10.0)
    return StoreConnector(config, ShardRunner(shard, fingerprint, num_layers, num_kv_heads, head_dim))


def store_url(kind: str, tmp_path: Path, request) -> str:
    """A test's store of kind file, redis or cluster (the redis_module / redis_cluster fixtures)."""
    if kind == "file":
        return f"file://{tmp_path}"
    if kind == "redis":
        return request.getfixturevalue("redis_module").url
    return request.getfixturevalue("redis_cluster").url


def spawn_writer(url: str, num_layers: int, rounds: int, stop_after: int | None = None, seed: int = 0,
                 tokens: int = 100) -> subprocess.Popen:
    args = [PYTHON, "-m", "tests.helpers.kvstore", url, FP, str(num_layers), str(rounds),
            *([] if stop_after is None else [str(stop_after)]), "--seed", str(seed), "--tokens", str(tokens)]
    return subprocess.Popen(args, cwd=Path(__file__).resolve().parents[2], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def start(writers: list[subprocess.Popen]) -> None:
    """Wait until every writer is ready (they start in parallel), then release them all at once."""
    for proc in writers:
        assert proc.stdout.readline().strip() == "ready"
    for proc in writers:
        proc.stdin.write("go\n")
        proc.stdin.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("url", "fingerprint"):
        parser.add_argument(name)
    for name in ("num_layers", "rounds"):
        parser.add_argument(name, type=int)
    parser.add_argument("stop_after", type=int, nargs="?")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokens", type=int, default=100)
    args = parser.parse_args()
    url, num_layers, rounds, stop_after = args.url, args.num_layers, args.rounds, args.stop_after
    keys, layers = make_chunks(args.tokens, num_layers, seed=args.seed)
    store = open_test_store(url, num_layers, fingerprint=args.fingerprint)
    print("ready", flush=True)
    sys.stdin.readline()
    if stop_after is not None:
        for i in range(stop_after):
            store.put_layer(i, layers[i])
        print("stopped", flush=True)
        time.sleep(600)
    for _ in range(rounds):
        write_all(store, keys, layers)
    store.close()


if __name__ == "__main__":
    main()
