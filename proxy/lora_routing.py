"""LoRA adapters across a P/D fleet: which nodes may serve an adapter's request, what /v1/models lists, and
vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter fanned out to every node.

Each node reports the adapters it serves, name and content fingerprint, in its Health reply
(serving/node_lora.py; Node.loras). A request whose `model` names an adapter goes only to nodes serving it:
the candidates are filtered here, before the routing policy ranks them (proxy/router.py stays the policy's
alone), and its decode only to nodes serving the weights its prefill ran under (the fingerprint the prefill
node answered with), so its KV and its tokens come from one adapter.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, Awaitable, Callable, Protocol, Sequence

import aiohttp
from aiohttp import web

from pdserve.protos import pdserve_pb2 as pb
from pdserve.proxy.health import Node
from pdserve.proxy.ranking import Ranking
from pdserve.serving import protocol as oai
from pdserve.serving.protocol_fields import APIError


class NodeRanking(Protocol):
    """What the proxy's request path asks of a Router (proxy/router.py)."""

    nodes: list[Node]

    def healthy(self) -> list[Node]: ...

    async def rank(self, lookup: pb.LookupRequest | None = None) -> Sequence[Node]: ...


class AdapterNodes:
    """A Router seen through one adapter: only nodes serving `name` (with `fingerprint`, when one is set).
    The policy still ranks them (the filter applies to its answer), so every policy works unchanged."""

    def __init__(self, router: NodeRanking, name: str, fingerprint: str = "") -> None:
        self.router = router
        self.name = name
        self.fingerprint = fingerprint

    @staticmethod
    def of(router: NodeRanking, name: str | None, fingerprint: str = "") -> NodeRanking:
        """`router` itself for the base model, else its view for the adapter."""
        return router if name is None else AdapterNodes(router, name, fingerprint)

    def serves(self, node: Node) -> bool:
        served = node.loras.get(self.name)
        return served is not None and (not self.fingerprint or served == self.fingerprint)

    @property
    def nodes(self) -> list[Node]:
        return [n for n in self.router.nodes if self.serves(n)]

    def healthy(self) -> list[Node]:
        return [n for n in self.router.healthy() if self.serves(n)]

    async def rank(self, lookup: pb.LookupRequest | None = None) -> Sequence[Node]:
        ranked = await self.router.rank(lookup)  # lazy (proxy/ranking.py): filtered as far as the caller reads
        return ranked.filter(self.serves) if isinstance(ranked, Ranking) else [n for n in ranked if self.serves(n)]

    def __getattr__(self, attr: str) -> Any:  # anything else a caller reads (counters, policy): the router's
        return getattr(self.router, attr)


def fleet_adapters(nodes: list[Node]) -> list[str]:
    """The adapters a request may name: those some healthy node of `nodes` (the decode nodes) serves."""
    names: dict[str, None] = {}
    for node in nodes:
        if node.healthy:
            names.update(dict.fromkeys(node.loras))
    return list(names)


def adapter_cards(names: list[str], parent: str) -> list[dict[str, Any]]:
    """/v1/models' cards of the fleet's adapters (vLLM's shape; the proxy does not know their directories)."""
    return [{"id": name, "object": "model", "owned_by": "pdserve", "root": name, "parent": parent}
            for name in names]


def _message(text: str) -> str:
    """A node's error message (vLLM's JSON body), else its text."""
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text.strip()


async def fan_out(nodes: list[Node], path: str, body: bytes, timeout_s: float = 120.0) -> str:
    """POST a load/unload `body` to every node's HTTP port: the nodes' success text once all of them said 200.
    Else an APIError naming the nodes that did not: the nodes' own 4xx when every node refused alike (a
    missing directory, a rank above the bound, an unknown name: the request is bad, nothing changed
    anywhere), a 503 otherwise (some nodes changed, some did not: the message says which)."""
    if not nodes:
        raise oai.service_unavailable("no node to load or unload the adapter on", "no_healthy_node")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
        answers = await asyncio.gather(*(node.post_http(http, path, body) for node in nodes))
    failed = [(node, status, text) for node, (status, text) in zip(nodes, answers) if status != 200]
    if not failed:
        return answers[0][1]
    named = "; ".join(f"{node.role} {node.address}: " + (f"HTTP {status} {_message(text)}" if status else text)
                      for node, status, text in failed)
    statuses = {status for _, status, _ in failed}
    if len(failed) == len(nodes) and len(statuses) == 1 and (status := statuses.pop()) and 400 <= status < 500:
        first = failed[0][2]
        try:
            err = json.loads(first)["error"]
        except (ValueError, KeyError, TypeError):
            err = {}
        err = err if isinstance(err, dict) else {}
        raise APIError(status, f"{_message(first)} (on every node: {named})", type=err.get("type"),
                       param=err.get("param"), code=err.get("code"))
    done = ", ".join(f"{node.role} {node.address}" for node, (status, _) in zip(nodes, answers) if status == 200)
    raise oai.service_unavailable(f"{path} failed on {len(failed)} of {len(nodes)} nodes: {named}"
                                  + (f" (done on {done})" if done else ""), "lora_fan_out_failed")


class FleetLoRAEndpoints:
    """pd-proxy's /v1/load_lora_adapter and /v1/unload_lora_adapter: fan_out to `nodes()`, then `refresh()` (a
    health check of every node) so the next request is routed by the adapters the nodes serve now."""

    def __init__(self, nodes: Callable[[], list[Node]], refresh: Callable[[], Awaitable[None]]) -> None:
        self.nodes = nodes
        self.refresh = refresh

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/load_lora_adapter", self.handle)
        app.router.add_post("/v1/unload_lora_adapter", self.handle)

    async def handle(self, request: web.Request) -> web.Response:
        try:
            text = await fan_out(self.nodes(), request.path, await request.read())
        finally:
            await self.refresh()
        return web.Response(status=200, text=text)
