"""Routing policies: which prefill or decode instance serves a request.

`rank()` returns the healthy instances best first, so a failed call can move on to the
next one without asking the policy again. The ranking is lazy and its order kept between requests
(proxy/ranking.py): a request costs the same at any fleet size, plus the index's candidates under kv-aware.
- round-robin: rotate through the instances.
- least-loaded (default): fewest outstanding requests (ours in flight, or the node's own
  running + waiting count from the last probe, whichever is larger).
- kv-aware: prefer the instance whose local prefix cache holds the longest prefix of the prompt; ties
  (e.g. a prefix seen nowhere yet) go to the least loaded. Repeated prefixes thereby return to where their
  KV is, as in Dynamo and llm-d. With KV events (`--kv-events`) the proxy's KVIndex (proxy/kv_index.py)
  answers from the chunk keys of the prompt's token ids: no RPC for token-id prompts (every decode call),
  one Tokenize call to one node for text and chat (the proxy has no tokenizer), whatever the fleet's size.
  Without events: ask each instance's `Lookup` (N calls), then prefer the most in its store.
"""
from __future__ import annotations

import asyncio
import itertools
import logging

import grpc

from pdserve.common.hashing import chunk_keys
from pdserve.protos import pdserve_pb2 as pb
from pdserve.proxy.health import Node
from pdserve.proxy.kv_index import KVIndex
from pdserve.proxy.ranking import LoadOrder, Members, Ranking

logger = logging.getLogger(__name__)

POLICIES = ("round-robin", "least-loaded", "kv-aware")
DEFAULT_POLICY = "least-loaded"


Group = tuple[str, int]  # (model fingerprint, chunk size): nodes whose chunk keys are computed alike


class Router:
    """Ranks its `nodes` for each request at a cost that does not grow with how many there are (beyond the
    index's candidates): the order it reads is kept as nodes change (proxy/ranking.py), and a ranking is lazy."""

    def __init__(self, nodes: list[Node], policy: str = DEFAULT_POLICY, lookup_timeout_s: float = 0.5,
                 index: KVIndex | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self._order = LoadOrder()
        self.nodes = nodes
        self.policy = policy
        self.lookup_timeout_s = lookup_timeout_s
        self.index = index  # kv-aware's source when the proxy reads KV events; None: Lookup calls
        self.lookup_rpcs = 0  # Lookup calls made (GET /fleet shows them: zero with an index)
        self.tokenize_rpcs = 0  # Tokenize calls made for the index (text and chat prompts)
        self._turn = itertools.count()
        self._groups: dict[Group, set[str]] = {}  # healthy nodes' addresses by the index's params
        self._groups_at: tuple[int, int] = (-1, -1)  # (order generation, index params_version) they were built at

    @property
    def nodes(self) -> list[Node]:
        """The members, in rotation order. The fleet appends and removes nodes; each change reaches the order."""
        return self._order.members

    @nodes.setter
    def nodes(self, nodes: list[Node]) -> None:
        self._order.members = Members(nodes, self._order.invalidate)
        self._order.invalidate()

    def healthy(self) -> list[Node]:
        return [n for n in self.nodes if n.healthy]

    async def rank(self, lookup: pb.LookupRequest | None = None) -> Ranking:
        """Healthy instances in order of preference for this request, computed as far as the caller reads."""
        order = self._order
        order.sync()
        if not order.healthy:
            return Ranking(())
        k = next(self._turn) % len(order.healthy)  # rotation also breaks ties fairly in the other policies
        if self.policy == "round-robin" or len(order.healthy) < 2:
            return Ranking(order.rotation(k))
        if self.policy == "least-loaded" or lookup is None:
            return Ranking(order.walk(k, []))
        if self.index is not None:
            return await self._rank_by_index(k, lookup)
        nodes = list(order.rotation(k))  # one Lookup per node: linear by nature
        hits = await asyncio.gather(*(self._hits(n, lookup) for n in nodes))
        ranked = sorted(range(len(nodes)), key=lambda i: (-hits[i][0], -hits[i][1], nodes[i].load.score))
        return Ranking([nodes[i] for i in ranked])

    def _key_groups(self, lookup: pb.LookupRequest) -> dict[tuple[str, int, str | None], set[str]]:
        """The healthy nodes that compute a request's keys alike (one group in a healthy fleet): model, chunk size
        and, for an adapter request, the adapter weights each serves under its name (their fingerprint roots the
        chain). The (model, chunk size) sets are rebuilt only when the members or the index's params change."""
        order, index = self._order, self.index
        assert index is not None
        if self._groups_at != (order.generation, index.params_version):
            self._groups = {}
            for n in order.healthy:
                if (params := index.params(n.address)) is not None:
                    self._groups.setdefault(params, set()).add(n.address)
            self._groups_at = (order.generation, index.params_version)
        adapter = lookup.lora.name if lookup.HasField("lora") else ""
        if not adapter or lookup.lora.fingerprint:
            return {(*g, lookup.lora.fingerprint or None): among for g, among in self._groups.items()}
        # An adapter named without its weights' fingerprint: each node's own (the one path that reads every node).
        split: dict[tuple[str, int, str | None], set[str]] = {}
        for g, among in self._groups.items():
            for a in among:
                split.setdefault((*g, order.by_address[a].loras.get(adapter)), set()).add(a)
        return split

    async def _rank_by_index(self, k: int, lookup: pb.LookupRequest) -> Ranking:
        """Longest local prefix first (the index's chunks), then least loaded; no call per node, and only the nodes
        holding the prefix scored: the rest follow lazily by load."""
        assert self.index is not None
        order = self._order
        groups = self._key_groups(lookup)
        if not groups:
            return Ranking(order.walk(k, []))
        ids = await self._token_ids(next(order.by_load(k)), lookup)  # the least loaded tokenizes
        if not ids:
            return Ranking(order.walk(k, []))
        depth: dict[str, int] = {}
        for (fingerprint, chunk_size, lora_fp), among in groups.items():
            keys = chunk_keys(fingerprint, ids, chunk_size, lookup.cache_salt or None, lora_fp)
            depth.update({a: d * chunk_size for a, d in self.index.local_chunks(keys, among).items()})
        order.sync()  # (a Tokenize call may have let the fleet change)
        if not order.healthy:
            return Ranking(())
        k %= len(order.healthy)
        held = [order.by_address[a] for a in depth if a in order.by_address]
        held.sort(key=lambda n: (-depth[n.address], *order.key(n, k)))
        return Ranking(order.walk(k, held, depth))

    async def _token_ids(self, node: Node, lookup: pb.LookupRequest) -> list[int]:
        """The prompt's token ids: as given, or one node's Tokenize (a hint: [] when it cannot say in time)."""
        prompt = lookup.prompt
        kind = prompt.WhichOneof("kind")
        if kind == "token_ids":
            return list(prompt.token_ids.ids)
        special = prompt.add_special_tokens if prompt.HasField("add_special_tokens") else kind == "text"
        self.tokenize_rpcs += 1
        try:
            reply = await node.stub.Tokenize(pb.TokenizeRequest(prompt=prompt, add_special_tokens=special),
                                             timeout=self.lookup_timeout_s)
        except grpc.aio.AioRpcError as e:
            logger.debug("tokenize on %s failed: %s", node.address, e.code().name)
            return []
        return list(reply.tokens)

    async def _hits(self, node: Node, lookup: pb.LookupRequest) -> tuple[int, int]:
        """(tokens in the node's prefix cache, tokens in its store); zeros when it cannot say in time.
        The store hit only differs between nodes whose stores differ (e.g. per-host file stores)."""
        self.lookup_rpcs += 1
        try:
            reply = await node.stub.Lookup(lookup, timeout=self.lookup_timeout_s)
        except grpc.aio.AioRpcError as e:
            logger.debug("lookup on %s failed: %s", node.address, e.code().name)
            return 0, 0
        return reply.local_hit_tokens, reply.store_hit_tokens
