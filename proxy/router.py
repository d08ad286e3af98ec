"""Routing policies: which prefill or decode instance serves a request.

`rank()` returns the healthy instances best first, so a failed call can move on to the
next one without asking the policy again.
- round-robin: rotate through the instances.
- least-loaded (default): fewest outstanding requests (ours in flight, or the node's own
  running + waiting count from the last probe, whichever is larger).
- kv-aware: ask each instance's `Lookup` how many prompt tokens its local prefix cache
  already holds and prefer the most, then the most in its store; ties (e.g. a prefix seen
  nowhere yet) go to the least loaded. Repeated prefixes thereby return to where their KV is, as in Dynamo and llm-d.
"""
from __future__ import annotations

import asyncio
import itertools
import logging

import grpc

from pdserve.protos import pdserve_pb2 as pb
from pdserve.proxy.health import Node

logger = logging.getLogger(__name__)

POLICIES = ("round-robin", "least-loaded", "kv-aware")
DEFAULT_POLICY = "least-loaded"


class Router:
    def __init__(self, nodes: list[Node], policy: str = DEFAULT_POLICY, lookup_timeout_s: float = 0.5) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.nodes = nodes
        self.policy = policy
        self.lookup_timeout_s = lookup_timeout_s
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
        hits = await asyncio.gather(*(self._hits(n, lookup) for n in nodes))
        order = sorted(range(len(nodes)), key=lambda i: (-hits[i][0], -hits[i][1], nodes[i].load.score))
        return [nodes[i] for i in order]

    async def _hits(self, node: Node, lookup: pb.LookupRequest) -> tuple[int, int]:
        """(tokens in the node's prefix cache, tokens in its store); zeros when it cannot say in time.
        The store hit only differs between nodes whose stores differ (e.g. per-host file stores)."""
        try:
            reply = await node.stub.Lookup(lookup, timeout=self.lookup_timeout_s)
        except grpc.aio.AioRpcError as e:
            logger.debug("lookup on %s failed: %s", node.address, e.code().name)
            return 0, 0
        return reply.local_hit_tokens, reply.store_hit_tokens
