"""Routing policies: which prefill or decode instance serves a request.

`rank()` returns the healthy instances best first, so a failed call can move on to the
next one without asking the policy again.
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

logger = logging.getLogger(__name__)

POLICIES = ("round-robin", "least-loaded", "kv-aware")
DEFAULT_POLICY = "least-loaded"


class Router:
    def __init__(self, nodes: list[Node], policy: str = DEFAULT_POLICY, lookup_timeout_s: float = 0.5,
                 index: KVIndex | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.nodes = nodes
        self.policy = policy
        self.lookup_timeout_s = lookup_timeout_s
        self.index = index  # kv-aware's source when the proxy reads KV events; None: Lookup calls
        self.lookup_rpcs = 0  # Lookup calls made (GET /fleet shows them: zero with an index)
        self.tokenize_rpcs = 0  # Tokenize calls made for the index (text and chat prompts)
        self._turn = itertools.count()

    def healthy(self) -> list[Node]:
        return [n for n in self.nodes if n.healthy]

    def _rotated(self, nodes: list[Node]) -> list[Node]:
        if not nodes:
            return nodes
        k = next(self._turn) % len(nodes)
        return nodes[k:] + nodes[:k]

    async def rank(self, lookup: pb.LookupRequest | None = None) -> list[Node]:
        """Healthy instances in order of preference for this request."""
        nodes = self._rotated(self.healthy())  # rotation also breaks ties fairly in the other policies
        if self.policy == "round-robin" or len(nodes) < 2:
            return nodes
        if self.policy == "least-loaded" or lookup is None:
            return sorted(nodes, key=lambda n: n.load.score)
        if self.index is not None:
            return await self._rank_by_index(nodes, lookup)
        hits = await asyncio.gather(*(self._hits(n, lookup) for n in nodes))
        order = sorted(range(len(nodes)), key=lambda i: (-hits[i][0], -hits[i][1], nodes[i].load.score))
        return [nodes[i] for i in order]

    async def _rank_by_index(self, nodes: list[Node], lookup: pb.LookupRequest) -> list[Node]:
        """Longest local prefix first (the index's chunks), then least loaded; no call per node."""
        assert self.index is not None
        by_load = sorted(nodes, key=lambda n: n.load.score)
        # nodes that compute keys alike (one group in a healthy fleet): model, chunk size and, for an adapter
        # request, the adapter weights each serves under its name (their fingerprint roots the chain)
        groups: dict[tuple[str, int, str | None], set[str]] = {}
        adapter = lookup.lora.name if lookup.HasField("lora") else ""
        for n in nodes:
            if (params := self.index.params(n.address)) is not None:
                lora_fp = (lookup.lora.fingerprint or n.loras.get(adapter)) if adapter else None
                groups.setdefault((*params, lora_fp), set()).add(n.address)
        if not groups:
            return by_load
        ids = await self._token_ids(by_load[0], lookup)
        if not ids:
            return by_load
        depth: dict[str, int] = {}
        for (fingerprint, chunk_size, lora_fp), among in groups.items():
            keys = chunk_keys(fingerprint, ids, chunk_size, lookup.cache_salt or None, lora_fp)
            depth.update({a: d * chunk_size for a, d in self.index.local_chunks(keys, among).items()})
        return sorted(by_load, key=lambda n: -depth.get(n.address, 0))  # stable: load breaks ties

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
