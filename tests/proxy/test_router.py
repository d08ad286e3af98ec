"""Router.rank() (proxy/router.py over proxy/ranking.py) without processes: the same order as ranking the fleet from
scratch on every request (the previous implementation, kept here as the reference) on random fleets that change
between requests, and a cost per request that does not grow with the fleet: node objects touched are counted,
never timed."""
from __future__ import annotations

import asyncio
import itertools
import random

import pytest

from pdserve.common.hashing import chunk_keys
from pdserve.protos import pdserve_pb2 as pb
from pdserve.proxy.health import Node
from pdserve.proxy.kv_index import KVIndex
from pdserve.proxy.lora_routing import AdapterNodes
from pdserve.proxy.ranking import Ranking
from pdserve.proxy.router import Router

FP, CHUNK = "e" * 32, 4


class Reference:
    """The ranking as computed before the order was kept: the healthy list rotated, sorted by load, grouped by the
    index's params and sorted by depth, every call."""

    def __init__(self, router: Router) -> None:
        self.router, self._turn = router, itertools.count()

    def rank(self, lookup: pb.LookupRequest | None) -> list[Node]:
        nodes = [n for n in self.router.nodes if n.healthy]
        if nodes:
            k = next(self._turn) % len(nodes)
            nodes = nodes[k:] + nodes[:k]
        if self.router.policy == "round-robin" or len(nodes) < 2:
            return nodes
        by_load = sorted(nodes, key=lambda n: n.load.score)
        if self.router.policy == "least-loaded" or lookup is None:
            return by_load
        index = self.router.index
        groups: dict[tuple, set[str]] = {}
        adapter = lookup.lora.name if lookup.HasField("lora") else ""
        for n in nodes:
            if (params := index.params(n.address)) is not None:
                lora_fp = (lookup.lora.fingerprint or n.loras.get(adapter)) if adapter else None
                groups.setdefault((*params, lora_fp), set()).add(n.address)
        if not groups:
            return by_load
        ids = list(lookup.prompt.token_ids.ids)
        depth: dict[str, int] = {}
        for (fingerprint, chunk_size, lora_fp), among in groups.items():
            keys = chunk_keys(fingerprint, ids, chunk_size, lookup.cache_salt or None, lora_fp)
            for a in among:  # each node's chunks read one by one (the index's own walk is what is checked)
                held = index.nodes[a].chunks
                depth[a] = chunk_size * next((i for i, key in enumerate(keys) if key not in held), len(keys))
        return sorted(by_load, key=lambda n: -depth.get(n.address, 0))


def _batch(node: str, seq: int, keys: list[str], kind: str = "snapshot") -> dict:
    return {"v": 1, "node": node, "boot": "b0", "seq": seq, "fp": FP, "chunk": CHUNK,
            "events": [{"kind": kind, "keys": keys}]}


def _lookup(ids: list[int], adapter: str | None = None) -> pb.LookupRequest:
    lora = pb.LoRAAdapter(name=adapter) if adapter else None
    return pb.LookupRequest(prompt=pb.Prompt(token_ids=pb.TokenIds(ids=ids)), lora=lora)


def _rank(router: Router, lookup: pb.LookupRequest | None = None) -> Ranking:
    return asyncio.run(router.rank(lookup))


@pytest.mark.parametrize("policy", ["round-robin", "least-loaded", "kv-aware"])
def test_the_order_is_the_from_scratch_order_as_the_fleet_changes(policy: str) -> None:
    rng = random.Random(policy)
    prompts = [[p * 1000 + i for i in range(24)] for p in range(4)]  # 6 chunks each
    for trial in range(20):
        index = KVIndex()
        nodes = [Node(f"n{i}:1", "prefill") for i in range(rng.randint(1, 12))]
        router = Router(list(nodes), policy, index=index)
        reference = Reference(router)
        seqs: dict[str, int] = {}
        for step in range(30):
            node = rng.choice(nodes)
            what = rng.random()
            if what < 0.4:  # a load change: ours or the node's probe
                node.load.in_flight = rng.randint(0, 3)
                node.load.num_running = rng.randint(0, 3)
            elif what < 0.55:
                node.healthy = not node.healthy
            elif what < 0.65 and node in router.nodes and len(router.nodes) > 1:
                router.nodes.remove(node)  # as the fleet does when a node leaves
                index.drop_node(node.address)
            elif what < 0.7 and node not in router.nodes:
                router.nodes.append(node)
            elif what < 0.9:  # KV events: a node's cache now holds a prefix of a prompt
                seqs[node.address] = seqs.get(node.address, 0) + 1
                keys = chunk_keys(FP, rng.choice(prompts), CHUNK)[:rng.randint(0, 6)]
                index.apply(_batch(node.address, seqs[node.address], keys))
            if rng.random() < 0.3:
                node.loras = {"sql": rng.choice(["f1", "f2"])}
            lookup = None if rng.random() < 0.1 else _lookup(rng.choice(prompts), rng.choice([None, None, "sql"]))
            got = [n.address for n in _rank(router, lookup)]
            assert got == [n.address for n in reference.rank(lookup)], (trial, step)


def test_a_ranking_read_on_after_the_fleet_changed_still_has_every_healthy_node_once() -> None:
    nodes = [Node(f"n{i}:1", "decode") for i in range(6)]
    for i, n in enumerate(nodes):
        n.healthy, n.load.in_flight = True, i % 3
    router = Router(nodes, "least-loaded")
    ranked = _rank(router)
    first = ranked[0]
    assert first.load.score == 0
    first.load.in_flight += 5  # the caller's own call, then it fails and reads on
    nodes[4].healthy = False
    rest = list(ranked)[1:]
    assert first not in rest and nodes[4] not in rest and len(rest) == 4
    assert [n.load.score for n in rest] == sorted(n.load.score for n in rest)


def test_adapter_candidates_are_filtered_lazily() -> None:
    nodes = [Node(f"n{i}:1", "prefill") for i in range(5)]
    for i, n in enumerate(nodes):
        n.healthy, n.loras, n.load.in_flight = True, ({"a": "f"} if i % 2 else {}), i
    router = Router(nodes, "least-loaded")
    ranked = asyncio.run(AdapterNodes.of(router, "a").rank())
    assert isinstance(ranked, Ranking) and ranked[0] is nodes[1] and [n.address for n in ranked] == ["n1:1", "n3:1"]


class Counted(Node):
    """A node that counts every attribute read on it: the measure of per-node work."""

    reads = 0

    def __getattribute__(self, name: str):
        Counted.reads += 1
        return super().__getattribute__(name)


def _fleet(n: int, holders: int) -> tuple[Router, list[Counted], pb.LookupRequest]:
    """n healthy prefill nodes of mixed loads; the first `holders` of them hold the prompt's first chunks."""
    rng = random.Random(n)
    index = KVIndex()
    nodes = [Counted(f"10.0.{i // 250}.{i % 250}:1", "prefill") for i in range(n)]
    ids = list(range(2048))
    keys = chunk_keys(FP, ids, CHUNK)
    for i, node in enumerate(nodes):
        node.healthy = True
        node.load.in_flight = rng.randint(0, 4)
        index.apply(_batch(node.address, 1, keys[:8 + i] if i < holders else []))
    router = Router(nodes, "kv-aware", index=index)
    _rank(router, _lookup(ids))[0]  # the first ranking builds the order: once per membership change
    return router, nodes, _lookup(ids)


def test_the_cost_of_a_request_does_not_grow_with_the_fleet() -> None:
    reads, ops = {}, {}
    for n in (8, 64, 1024):
        router, nodes, lookup = _fleet(n, holders=3)
        Counted.reads, router.index.ops = 0, 0
        for i in range(10):  # the proxy's path: rank, take the first, count it in flight, and done
            node = _rank(router, lookup)[0]
            node.load.in_flight += 1
            least = _rank(router, None)[0]
            least.load.in_flight -= 1 if least.load.in_flight else 0
        reads[n], ops[n] = Counted.reads, router.index.ops
    assert reads[8] == reads[64] == reads[1024], reads
    assert ops[8] == ops[64] == ops[1024], ops  # the index's walk: the 3 holders, whatever the fleet


def test_a_membership_change_is_paid_once_not_per_request() -> None:
    router, nodes, lookup = _fleet(256, holders=3)
    router.nodes.append(Counted("10.9.9.9:1", "prefill"))
    Counted.reads = 0
    _rank(router, lookup)[0]
    rebuild = Counted.reads
    Counted.reads = 0
    _rank(router, lookup)[0]
    assert rebuild > 256 > Counted.reads  # the rebuild reads every node; the next request does not
