"""The planner's driver in pd-proxy: figures in, switches out, `GET /planner`, the replica gauges.

Every `interval_s` it reads each healthy node's figures (its outstanding requests from the health probe;
its TTFT and ITL p90 over `window_s` from the /metrics samples the health monitor already takes:
proxy/node_figures.py), asks the planner (proxy/planner.py) for a decision and logs it as one line. Its
switches are carried out here, all at once: each node leaves this proxy's rotation, `SetRole` drains and moves
it (the node re-announces itself under its new role), and the fleet is polled at once so it routes to the node
in its new role. Admission control (proxy/admission.py) reads `saturated()` from the same figures.
Over a fleet registry only the proxy holding the planner lease decides (proxy/planner_lease.py); the others hold.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Iterator

import grpc
from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdserve.protos import pdserve_pb2 as pb
from pdserve.proxy.fleet import Fleet
from pdserve.proxy.health import Node
from pdserve.proxy.node_figures import SAMPLE_S, Sample, quantile
from pdserve.proxy.planner import DECODE, PREFILL, ROLES, NodeFigure, Planner, PlannerConfig, Switch
from pdserve.proxy.planner_lease import PlannerLease

logger = logging.getLogger(__name__)

_SATURATED_TTL_S = 0.1  # every queued request asks saturated() each admission poll: read the figures once per this


def p90_ms(samples: list[Sample], window_s: float, which: str, now: float) -> float | None:
    """The p90 (ms) of histogram `which` ("ttft" | "itl") over the newest `window_s` of samples (all of them
    when they span less); None without two samples, with an observation between them, or when the newest is
    older than the window (samples that stopped coming must not keep an old burst's latency alive)."""
    if len(samples) < 2 or now - samples[-1].t > window_s:
        return None
    latest = samples[-1]
    base = next((s for s in reversed(samples) if latest.t - s.t >= window_s), samples[0])
    new, old = getattr(latest, which), getattr(base, which)
    window = {le: count - old.get(le, 0.0) for le, count in new.items()}
    if any(v < 0 for v in window.values()):  # the node restarted inside the window: its counts are all new
        window = dict(new)
    q = quantile(0.9, window)
    return None if q is None else q * 1e3


def sample_interval(config: PlannerConfig) -> float:
    """How often the health monitor samples the nodes' /metrics: at least once per planner decision."""
    return min(SAMPLE_S, config.interval_s) if config.enabled else SAMPLE_S


def figure_of(node: Node, window_s: float, now: float) -> NodeFigure:
    """`now`: Unix time, the samples' clock."""
    samples = list(node.figures.samples)
    return NodeFigure(node.address, node.role, bool(node.announcement and node.announcement.switchable),
                      node.load.score, p90_ms(samples, window_s, "ttft", now), p90_ms(samples, window_s, "itl", now))


class PlannerLoop:
    def __init__(self, config: PlannerConfig, fleet: Fleet, nodes: Callable[[], list[Node]],
                 lease: PlannerLease | None = None) -> None:
        self.config = config
        self.lease = lease  # None: this proxy plans alone (no registry)
        self.planner = Planner(config)
        self.fleet = fleet
        self.nodes = nodes
        self.switches = 0
        self.failed_switches = 0
        self._task: asyncio.Task | None = None
        self._saturated = (-1.0, False)  # (monotonic time, answer): saturated()'s last reading

    def figures(self) -> list[NodeFigure]:
        now = time.time()
        return [figure_of(n, self.config.window_s, now) for n in self.nodes() if n.healthy]

    def saturated(self) -> bool:
        """Every decode node in rotation past the ITL SLO (admission control's trigger); False without one."""
        slo, now = self.config.slo_itl_ms, time.monotonic()
        if slo is None:
            return False
        if now - self._saturated[0] >= _SATURATED_TTL_S:
            itl = [f.itl_p90_ms for f in self.figures() if f.role == DECODE]
            self._saturated = (now, bool(itl) and all(v is not None and v > slo for v in itl))
        return self._saturated[1]

    def start(self) -> None:
        if self.config.enabled:
            self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.lease is not None:
            await self.lease.release()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.config.interval_s)
            if self.lease is not None and not await self.lease.held():
                continue  # another proxy's planner moves the fleet's nodes
            try:
                await self._decide(loop.time())
            except Exception:  # one bad round must not end the fleet's planner (a task's error is silent)
                logger.exception("planner: decision round failed; the next one comes in %.1f s", self.config.interval_s)

    async def _decide(self, now: float) -> None:
        decision = self.planner.decide(self.figures(), now)
        repeat = len(self.planner.decisions) > 1 and self.planner.decisions[-2].reason == decision.reason
        # One line per decision; a hold repeating the last reason only at DEBUG (one every interval otherwise)
        logger.log(logging.DEBUG if repeat and decision.switch is None else logging.INFO, decision.line())
        # the nodes of one decision drain at once: the fleet needs them all in their new role
        await asyncio.gather(*(self.switch(move) for move in decision.switches))

    async def switch(self, move: Switch) -> bool:
        """Carry out one switch: out of this proxy's rotation, SetRole (the node drains and re-announces), poll the
        fleet. False (one line) when the node is gone or the call fails; the health probe brings it back."""
        node = self.fleet.members.get((move.from_role, move.address))
        if node is None or node.stub is None:
            logger.warning("%s: planner switch to %s skipped: no longer a %s member of the fleet", move.address,
                           move.to_role, move.from_role)
            self.failed_switches += 1
            return False
        node.mark_down(f"switching to {move.to_role} (planner)")  # no new request of ours while it drains
        timeout_s = self.config.drain_timeout_s
        # counted in flight: the node re-announces itself in its new role before it answers, and the fleet keeps
        # the channel of its old membership open only while calls of ours run on it (proxy/fleet.py _retire)
        node.load.in_flight += 1
        try:
            reply = await node.stub.SetRole(pb.SetRoleRequest(role=move.to_role, drain_timeout_s=timeout_s),
                                            timeout=timeout_s + 10.0)
        except grpc.aio.AioRpcError as e:
            logger.warning("%s: planner switch %s -> %s failed: %s: %s", move.address, move.from_role, move.to_role,
                           e.code().name, e.details())
            self.failed_switches += 1
            return False
        finally:
            node.load.in_flight -= 1
        await self.fleet.poll_now()
        self.switches += 1
        logger.info("%s: switched %s -> %s by the planner: drained in %.1f ms, %d old calls still running",
                    move.address, reply.previous_role, reply.role, reply.drain_ms, reply.still_running)
        return True

    # ------------------------------------------------------------ GET /planner, /metrics
    def status(self) -> dict[str, object]:
        last = self.planner.decisions[-1] if self.planner.decisions else None
        current = {r: sum(n.role == r for n in self.nodes()) for r in ROLES}
        return {"enabled": self.config.enabled,
                "slo": {"ttft_ms": self.config.slo_ttft_ms, "itl_ms": self.config.slo_itl_ms},
                "interval_s": self.config.interval_s, "window_s": self.config.window_s,
                "hysteresis": self.config.hysteresis, "cooldown_s": self.config.cooldown_s,
                "max_step": self.config.max_step, "lead": self.config.lead, "slack": self.config.slack,
                "current": current, "targets": last.targets if last else current,
                "desired_replicas": last.desired if last else current, "switches": self.switches,
                "failed_switches": self.failed_switches,
                "lease": self.lease.status() if self.lease is not None else None,
                "decisions": [d.to_json() for d in reversed(self.planner.decisions)]}

    async def handle(self, request: web.Request) -> web.Response:
        return web.json_response(self.status())

    def collect(self) -> Iterator:
        """The figures an HPA or KEDA scales each role's Deployment by (deploy/kubernetes/autoscaling.yaml)."""
        desired = GaugeMetricFamily("pdserve_planner_desired_replicas", "Nodes the planner wants per role "
                                    "(current x latency p90 / SLO, at least 1).", labels=["role"])
        status = self.status()
        for role in (PREFILL, DECODE):
            desired.add_metric([role], status["desired_replicas"][role])  # type: ignore[index]
        switches = CounterMetricFamily("pdserve_planner_switches", "Role switches the planner carried out.")
        switches.add_metric([], self.switches)
        yield from (desired, switches)
