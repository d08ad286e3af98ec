"""A --role auto node's SetRole (serving/node_grpc.py), without processes: it refuses the old role's new calls,
waits for the running ones up to its deadline, re-announces, and a fixed-role node refuses to switch."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from pdserve.protos import pdserve_pb2 as pb
from pdserve.serving.node_grpc import NodeServicer


class Aborted(Exception):
    pass


class Context:
    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


def _servicer(switchable: bool = True) -> NodeServicer:
    server = SimpleNamespace(async_engine=None, engine=None)
    return NodeServicer(server, "decode", switchable=switchable)


def test_set_role_drains_then_re_announces() -> None:
    async def main() -> None:
        servicer = _servicer()
        announced: list[str] = []

        async def announce(role: str) -> None:
            announced.append(role)

        servicer.on_role_change = announce
        servicer.running["decode"] = 1  # a stream still running
        switch = asyncio.create_task(servicer.SetRole(pb.SetRoleRequest(role="prefill", drain_timeout_s=600),
                                                      Context()))
        await asyncio.sleep(0.2)
        assert not switch.done() and servicer.role == "prefill" and announced == []  # draining; new role already
        with pytest.raises(Aborted) as refused:  # a new decode call: another node takes it
            await servicer._refuse_other_role("decode", Context())
        assert refused.value.args[0] == grpc.StatusCode.UNAVAILABLE
        servicer.running["decode"] = 0
        reply = await asyncio.wait_for(switch, 600)
        assert (reply.role, reply.previous_role, reply.still_running) == ("prefill", "decode", 0)
        assert announced == ["prefill"]
        await servicer._refuse_other_role("prefill", Context())  # the new role's calls run

    asyncio.run(main())


def test_a_drain_past_its_deadline_switches_with_calls_still_running() -> None:
    async def main() -> None:
        servicer = _servicer()
        servicer.running["decode"] = 2
        reply = await servicer.SetRole(pb.SetRoleRequest(role="prefill", drain_timeout_s=0.01), Context())
        assert reply.role == "prefill" and reply.still_running == 2

    asyncio.run(main())


def test_a_fixed_role_node_refuses_to_switch_and_serves_any_call() -> None:
    async def main() -> None:
        servicer = _servicer(switchable=False)
        with pytest.raises(Aborted) as refused:
            await servicer.SetRole(pb.SetRoleRequest(role="prefill"), Context())
        assert refused.value.args[0] == grpc.StatusCode.FAILED_PRECONDITION
        await servicer._refuse_other_role("prefill", Context())
        with pytest.raises(Aborted) as bad:
            await _servicer().SetRole(pb.SetRoleRequest(role="both"), Context())
        assert bad.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT

    asyncio.run(main())
