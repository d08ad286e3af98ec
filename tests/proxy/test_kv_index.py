"""The proxy's KV index (proxy/kv_index.py) and the node's publisher (serving/kv_events.py), without processes:
events in, routes out; lost, late and duplicated batches; the routing cost against the fleet's size."""
from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from pdserve.common.hashing import chunk_keys
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.proxy.kv_index import KVIndex
from pdserve.serving.kv_events import FIELD, KVEventPublisher

FP = "f" * 32


def _batch(node: str, seq: int, *events: tuple[str, list[str]], boot: str = "b0", chunk: int = 4) -> dict:
    return {"v": 1, "node": node, "boot": boot, "seq": seq, "fp": FP, "chunk": chunk,
            "events": [{"kind": k, "keys": keys} for k, keys in events]}


def _keys(n_tokens: int, start: int = 0) -> list[str]:
    return chunk_keys(FP, list(range(start, start + n_tokens)), 4)


def test_longest_prefix_and_snapshot_and_leave() -> None:
    index, keys = KVIndex(), _keys(16)
    index.apply(_batch("a", 1, ("snapshot", [])))
    index.apply(_batch("a", 2, ("stored", keys[:2])))
    index.apply(_batch("b", 1, ("snapshot", keys[:4])))
    assert index.local_chunks(keys, {"a", "b"}) == {"a": 2, "b": 4}
    index.apply(_batch("b", 2, ("removed", keys[1:2])))  # a gap in b's prefix: its hit ends there
    assert index.local_chunks(keys, {"a", "b"}) == {"a": 2, "b": 1}
    index.apply(_batch("b", 3, ("snapshot", keys[:1])))  # replaces b's entries
    assert index.local_chunks(keys, {"a", "b"}) == {"a": 2, "b": 1}
    index.drop_node("a")
    assert index.local_chunks(keys, {"a", "b"}) == {"b": 1}
    assert index.params("a") is None and index.params("b") == (FP, 4)


def test_duplicates_gaps_restarts_and_garbage() -> None:
    index, keys = KVIndex(), _keys(8)
    index.apply(_batch("a", 1, ("snapshot", keys)))
    index.apply(_batch("a", 1, ("removed", keys)))  # a duplicate: ignored
    assert index.duplicates == 1 and index.local_chunks(keys, {"a"}) == {"a": 2}
    index.apply(_batch("a", 5, ("removed", keys[1:])))  # batches 2..4 lost: counted, the rest applies
    assert index.gaps == 1 and index.local_chunks(keys, {"a"}) == {"a": 1}
    index.apply(_batch("a", 1, ("snapshot", []), boot="b1"))  # restarted: its old entries go
    assert index.local_chunks(keys, {"a"}) == {}
    for bad in ({}, {"node": "a"}, _batch("a", "x")):  # type: ignore[arg-type]
        try:
            index.apply(bad)
        except ValueError:
            continue
        raise AssertionError(f"accepted {bad}")


def test_bounded_lru() -> None:
    index = KVIndex(max_chunks=3)
    keys = _keys(40)
    index.apply(_batch("a", 1, ("snapshot", keys)))
    assert index.status()["chunks"] == 3 and index.status()["nodes"] == {"a": 3}
    index.apply(_batch("a", 2, ("store_committed", keys)))
    assert index.status()["store_chunks"] == 3


def _ops_for(n_nodes: int) -> int:
    """One lookup's work in a fleet of `n_nodes`, each holding its own prefixes and one holding the request's."""
    index, keys = KVIndex(), _keys(64)
    for i in range(n_nodes):
        index.apply(_batch(f"n{i}", 1, ("snapshot", _keys(64, start=1000 * (i + 1)))))
    index.apply(_batch("n0", 2, ("stored", keys[:8])))
    before = index.ops
    assert index.local_chunks(keys, {f"n{i}" for i in range(n_nodes)}) == {"n0": 8}
    return index.ops - before


def test_routing_cost_does_not_grow_with_the_fleet() -> None:
    assert _ops_for(2) == _ops_for(50)


class _Redis:
    def __init__(self) -> None:
        self.entries: list[dict] = []

    def xadd(self, stream: str, fields: dict[str, str], **_: Any) -> None:
        self.entries.append(json.loads(fields[FIELD]))

    def close(self) -> None:
        pass


def test_publisher_maps_blocks_to_chunks() -> None:
    """A KVCacheManager's inserts and evictions as chunk keys: a chunk counts once all its blocks are cached,
    and goes when any is evicted; a full queue drops and the next batch is a snapshot."""
    kv = KVCacheManager(num_blocks=6, block_size=2, fingerprint=FP)
    redis = _Redis()
    pub = KVEventPublisher("redis://unused", "a:1", FP, 2, 4, lambda: set(kv.pool.cached), client=redis,
                           max_queue=2)
    kv.set_listener(pub)
    pub.flush()
    assert redis.entries[-1]["events"] == [{"kind": "snapshot", "keys": []}]
    req = Request("r", list(range(10)), SamplingParams(max_tokens=1))
    kv.allocate_slots(req, 10)
    kv.cache_blocks(req, 6)  # 3 blocks: chunk 0 complete, chunk 1 half
    kv.cache_blocks(req, 10)  # 5 blocks: chunk 1 complete too
    pub.flush()
    keys = chunk_keys(FP, list(range(10)), 4)
    assert [e["keys"] for e in redis.entries[-1]["events"]] == [keys[:1], keys[1:2]]
    kv.free(req)
    other = Request("s", list(range(100, 112)), SamplingParams(max_tokens=1))
    kv.allocate_slots(other, 12)  # takes every block: evicts both chunks' blocks
    pub.flush()
    assert sorted(redis.entries[-1]["events"][0]["keys"]) == sorted(keys[:2])
    assert redis.entries[-1]["events"][0]["kind"] == "removed"
    for _ in range(3):
        pub.blocks_removed([b"x"])  # the third overflows the queue
    assert pub.dropped == 1
    pub.flush()
    assert redis.entries[-1]["events"] == [{"kind": "snapshot", "keys": []}]
    index = KVIndex()
    for entry in redis.entries:
        index.apply(entry)
    assert index.gaps == 0 and index.local_chunks(keys, {"a:1"}) == {}


def test_router_ranks_from_the_index_without_calls() -> None:
    import asyncio

    from pdserve.protos import pdserve_pb2 as pb
    from pdserve.proxy.router import Router

    index, ids = KVIndex(), list(range(12))
    keys = chunk_keys(FP, ids, 4)
    index.apply(_batch("b:1", 1, ("snapshot", keys[:2])))
    index.apply(_batch("a:1", 1, ("snapshot", [])))
    nodes = [SimpleNamespace(address=a, healthy=True, load=SimpleNamespace(score=s), loras={}) for a, s in
             (("a:1", 0), ("b:1", 5))]
    router = Router(nodes, "kv-aware", index=index)  # type: ignore[arg-type]
    lookup = pb.LookupRequest(prompt=pb.Prompt(token_ids=pb.TokenIds(ids=ids)))
    ranked = asyncio.run(router.rank(lookup))
    assert [n.address for n in ranked] == ["b:1", "a:1"] and router.lookup_rpcs == 0
    other = pb.LookupRequest(prompt=pb.Prompt(token_ids=pb.TokenIds(ids=[99] * 12)))
    assert [n.address for n in asyncio.run(router.rank(other))] == ["a:1", "b:1"]  # no hit: least loaded


def test_an_adapter_request_is_ranked_by_that_adapters_keys() -> None:
    """The adapter's fingerprint roots its chunk keys: a node holding the base model's KV for the prompt scores
    nothing for an adapter request, the node holding the adapter's KV (the weights it serves under the name)
    scores its prefix."""
    import asyncio

    from pdserve.protos import pdserve_pb2 as pb
    from pdserve.proxy.router import Router

    index, ids, lora_fp = KVIndex(), list(range(12)), "f" * 32
    index.apply(_batch("base:1", 1, ("snapshot", chunk_keys(FP, ids, 4)[:2])))
    index.apply(_batch("lora:1", 1, ("snapshot", chunk_keys(FP, ids, 4, None, lora_fp)[:1])))
    nodes = [SimpleNamespace(address=a, healthy=True, load=SimpleNamespace(score=s), loras={"sql": lora_fp})
             for a, s in (("base:1", 0), ("lora:1", 5))]
    router = Router(nodes, "kv-aware", index=index)  # type: ignore[arg-type]
    prompt = pb.Prompt(token_ids=pb.TokenIds(ids=ids))
    as_base = asyncio.run(router.rank(pb.LookupRequest(prompt=prompt)))
    as_adapter = asyncio.run(router.rank(pb.LookupRequest(prompt=prompt, lora=pb.LoRAAdapter(name="sql"))))
    assert [n.address for n in as_base] == ["base:1", "lora:1"]
    assert [n.address for n in as_adapter] == ["lora:1", "base:1"] and router.lookup_rpcs == 0
