"""pd-proxy's LoRA pieces alone (proxy/lora_routing.py): candidates filtered by the adapters nodes report, the
fleet's adapter list, and how a load/unload fan-out's answers become one status (no processes)."""
from __future__ import annotations

import asyncio
import json

import pytest

from pdserve.proxy.health import Node
from pdserve.proxy.lora_routing import AdapterNodes, fan_out, fleet_adapters
from pdserve.proxy.router import Router
from pdserve.serving.protocol_fields import APIError


def _node(address: str, loras: dict[str, str], healthy: bool = True, answer: tuple[int | None, str] = (200, "ok")):
    node = Node(address, "decode")
    node.healthy, node.loras = healthy, loras

    async def post_http(http, path, body=b""):
        return answer

    node.post_http = post_http
    return node


def test_candidates_are_the_nodes_serving_the_adapter_with_the_pinned_weights():
    a1, a2, base = _node("n1:1", {"a": "f1"}), _node("n2:1", {"a": "f2", "b": "g"}), _node("n3:1", {})
    router = Router([a1, a2, base], "round-robin")
    assert AdapterNodes.of(router, None) is router
    assert {n.address for n in asyncio.run(AdapterNodes.of(router, "a").rank())} == {"n1:1", "n2:1"}
    assert [n.address for n in AdapterNodes.of(router, "a", "f2").healthy()] == ["n2:1"]
    assert AdapterNodes.of(router, "c").healthy() == []
    a2.healthy = False
    assert fleet_adapters([a1, a2, base]) == ["a"]  # out of rotation: its adapters are not offered


def _error(status: int, message: str) -> str:
    return json.dumps({"error": {"message": message, "type": "BadRequestError", "param": "lora_path", "code": None}})


def test_fan_out_answers_200_only_when_every_node_did():
    nodes = [_node("p:1", {}, answer=(200, "Success")), _node("d:1", {}, answer=(200, "Success"))]
    assert asyncio.run(fan_out(nodes, "/v1/load_lora_adapter", b"{}")) == "Success"


def test_the_same_refusal_on_every_node_is_that_4xx_naming_them():
    bad = (400, _error(400, "path does not exist"))
    with pytest.raises(APIError) as e:
        asyncio.run(fan_out([_node("p:1", {}, answer=bad), _node("d:1", {}, answer=bad)], "/v1/load_lora_adapter", b""))
    assert e.value.status == 400 and e.value.type == "BadRequestError"
    assert "path does not exist" in e.value.message and "p:1" in e.value.message and "d:1" in e.value.message


def test_a_partial_fan_out_is_a_503_saying_where_it_did_and_did_not_happen():
    nodes = [_node("p:1", {}, answer=(200, "Success")), _node("d:1", {}, answer=(None, "connection refused"))]
    with pytest.raises(APIError) as e:
        asyncio.run(fan_out(nodes, "/v1/unload_lora_adapter", b""))
    assert e.value.status == 503 and "1 of 2 nodes" in e.value.message
    assert "decode d:1: connection refused" in e.value.message and "done on decode p:1" in e.value.message
