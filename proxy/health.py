"""Node handles and health checking: dead instances leave rotation, recovered ones come back.

A node is healthy once its `Health` RPC answers; any failed periodic check, or an
UNAVAILABLE from a request's own RPC, takes it out at once. Stats from the same probe
feed the least-loaded policy. Every SAMPLE_S the monitor also reads each healthy node's
/metrics on its HTTP port for the status page (proxy/node_figures.py); routing never uses them.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import aiohttp
import grpc

from pdserve.protos import KEEPALIVE_CLIENT_OPTIONS, MESSAGE_LIMITS
from pdserve.protos import pdserve_pb2 as pb
from pdserve.protos import pdserve_pb2_grpc as pb_grpc
from pdserve.proxy.node_figures import SAMPLE_S, NodeFigures, parse
from pdserve.serving.auth import GrpcSecurity, node_channel

logger = logging.getLogger(__name__)

# Reconnect quickly after a node restarts (gRPC's default backoff grows to 2 minutes).
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
    *MESSAGE_LIMITS,
    *KEEPALIVE_CLIENT_OPTIONS,  # a silent (partitioned) node fails its calls within ~10 s
]


_SAMPLE_TIMEOUT_S = 1.0


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _http_base(grpc_address: str, port: int) -> str:
    """http://host:port for the host of a node's gRPC address (IPv6 literals bracketed)."""
    host = grpc_address.rpartition(":")[0]
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


_SCORED = frozenset({"in_flight", "num_running", "num_waiting"})


@dataclass
class NodeLoad:
    """What the last probe said, plus what this proxy has in flight there right now."""

    in_flight: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    kv_usage: float = 0.0
    prefix_cache_queries: int = 0  # prompt tokens, since the node started
    prefix_cache_hits: int = 0
    # called after a field behind `score` is set: a router keeps its load order current (proxy/ranking.py) instead
    # of sorting the fleet on every request
    watchers: list[Callable[[], None]] = field(default_factory=list, repr=False, compare=False)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name in _SCORED:
            for watcher in self.__dict__.get("watchers", ()):
                watcher()

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else None

    @property
    def score(self) -> int:
        """Outstanding requests: the node's own (possibly stale) count or ours, whichever is larger."""
        return max(self.in_flight, self.num_running + self.num_waiting)


class Node:
    """One prefill or decode instance reached over gRPC."""

    def __init__(self, address: str, role: str, security: GrpcSecurity = GrpcSecurity()) -> None:
        self.address = address
        self.role = role
        self.security = security
        self.channel: grpc.aio.Channel | None = None
        self.stub: pb_grpc.PDNodeStub | None = None
        self.watchers: list[Callable[[], None]] = []  # called when `healthy` changes (its routers rebuild their order)
        self._healthy = False
        self.load = NodeLoad()
        self.routed = 0
        self.last_error: str | None = None
        self.model_names: list[str] = []
        self.max_model_len = 0
        self.http_port = 0  # where the node serves HTTP (/metrics), from its Health answer
        self.loras: dict[str, str] = {}  # LoRA adapters it serves: name -> fingerprint, from its Health answer
        self.figures = NodeFigures()
        self.source = "static"  # how the proxy found it (proxy/fleet_sources.py), since when (Unix time)
        self.since = time.time()
        self.announcement: Any = None  # serving.announce.Announcement of a node found in the fleet registry

    @property
    def healthy(self) -> bool:
        """In rotation."""
        return self._healthy

    @healthy.setter
    def healthy(self, value: bool) -> None:
        if value != self._healthy:
            self._healthy = value
            for watcher in list(self.watchers):
                watcher()

    @property
    def http_url(self) -> str | None:
        """The node's HTTP base URL, once a Health answer told its port."""
        return _http_base(self.address, self.http_port) if self.http_port else None

    @property
    def metrics_url(self) -> str | None:
        return self.http_url + "/metrics" if self.http_port else None

    async def post_http(self, http: aiohttp.ClientSession, path: str, body: bytes = b"") -> tuple[int | None, str]:
        """(HTTP status, body text) of a POST to the node's HTTP port (the proxy's fan-outs: /reset_prefix_cache,
        LoRA loads); (None, why) when it gave none."""
        if not self.http_url:
            return None, "its HTTP port is not known yet (never in rotation)"
        try:
            async with http.post(self.http_url + path, data=body, headers={"Content-Type": "application/json"}) as r:
                return r.status, await r.text()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return None, str(e) or type(e).__name__

    def connect(self) -> None:
        """Open the channel; inside the running event loop, which grpc.aio binds it to."""
        self.channel = node_channel(self.address, self.security, _CHANNEL_OPTIONS)
        self.stub = pb_grpc.PDNodeStub(self.channel)

    async def ready(self, timeout_s: float) -> None:
        """Return once the channel is connected; asyncio.TimeoutError when it is not within `timeout_s`,
        at once when the last attempt failed (a dead node's calls must not wait out a reconnect backoff)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        state = self.channel.get_state(try_to_connect=True)
        while state != grpc.ChannelConnectivity.READY:
            if state in (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN):
                raise asyncio.TimeoutError("unreachable (its last connection attempt failed)")
            try:
                await asyncio.wait_for(self.channel.wait_for_state_change(state), deadline - loop.time())
            except asyncio.TimeoutError:
                raise asyncio.TimeoutError(f"not connected within {timeout_s:g}s") from None
            state = self.channel.get_state(try_to_connect=True)

    def generate(self, call: pb.GenerateRequest) -> grpc.aio.UnaryStreamCall:
        """Start a Generate call: a stream of deltas."""
        return self.stub.Generate(call)

    def mark_down(self, reason: str) -> None:
        """Out of rotation for `reason` (`last_error`, what /status and the dashboard show).

        A request that notices the node left while it waited quotes `last_error` in its own reason and
        reports it here too: such a notice keeps the cause it quotes, else every request in flight would
        nest it one level deeper (24 prefills on a dying node logged "left rotation while prefilling
        (left rotation while prefilling (...))" 22 deep). A new cause (the next probe's) replaces it."""
        if self.healthy:
            logger.warning("%s node %s out of rotation: %s", self.role, self.address, reason)
        elif self.last_error and self.last_error in reason:
            return
        self.healthy = False
        self.last_error = reason

    async def probe(self, timeout_s: float) -> None:
        """Health + Stats in one go; raises grpc.aio.AioRpcError / asyncio.TimeoutError on failure."""
        health = await self.stub.Health(pb.HealthRequest(), timeout=timeout_s)
        stats = await self.stub.Stats(pb.StatsRequest(), timeout=timeout_s)
        if not health.ok:
            raise RuntimeError("node reports not ok (shutting down)")
        if health.switchable and health.role != self.role:  # moved by a planner: the fleet re-lists it
            raise RuntimeError(f"serves as {health.role} now")
        self.model_names, self.max_model_len = list(health.served_model_names), health.max_model_len
        self.http_port = health.http_port
        self.loras = {a.name: a.fingerprint for a in health.loras}
        self.load.num_running, self.load.num_waiting = stats.num_running, stats.num_waiting
        self.load.num_free_blocks, self.load.num_total_blocks = stats.num_free_blocks, stats.num_total_blocks
        self.load.kv_usage = stats.kv_usage
        self.load.prefix_cache_queries, self.load.prefix_cache_hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        if not self.healthy:
            logger.info("%s node %s in rotation (model %s)", self.role, self.address, self.model_names[0])
        self.healthy = True
        self.last_error = None

    def status(self) -> dict[str, object]:
        return {"address": self.address, "role": self.role, "healthy": self.healthy, "routed": self.routed,
                "in_flight": self.load.in_flight, "running": self.load.num_running,
                "waiting": self.load.num_waiting, "free_blocks": self.load.num_free_blocks,
                "total_blocks": self.load.num_total_blocks, "kv_usage": round(self.load.kv_usage, 4),
                "prefix_cache_hit_rate": _round(self.load.prefix_cache_hit_rate), "last_error": self.last_error,
                "metrics_url": self.metrics_url, "source": self.source,
                "metrics": self.figures.status()}

    async def sample_metrics(self, http: aiohttp.ClientSession, tick: float, timeout_s: float) -> None:
        """One /metrics sample for the status page; a failure is noted on the figures, never raised."""
        url = self.metrics_url
        if url is None:
            return
        try:
            async with http.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                if resp.status != 200:
                    raise aiohttp.ClientError(f"HTTP {resp.status}")
                self.figures.add(parse(await resp.text(), tick))
            self.figures.last_error = None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            if self.figures.last_error is None:
                logger.info("%s node %s: no metrics sample from %s (%s)", self.role, self.address, url,
                            str(e) or type(e).__name__)
            self.figures.last_error = str(e) or type(e).__name__

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()


class HealthMonitor:
    """Probes every node each `interval_s` in the background, and samples the healthy nodes' /metrics each
    `sample_s` for the status page. `nodes()` says which nodes there are now (the fleet changes them)."""

    def __init__(self, nodes: Callable[[], list[Node]], interval_s: float = 1.0, timeout_s: float = 1.0,
                 sample_s: float = SAMPLE_S) -> None:
        self.nodes = nodes
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.sample_s = sample_s
        self._task: asyncio.Task | None = None
        self._sampler: asyncio.Task | None = None

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(node) for node in self.nodes()))

    async def check(self, node: Node) -> None:
        try:
            await node.probe(self.timeout_s)
        except grpc.aio.AioRpcError as e:
            node.mark_down(f"{e.code().name}: {e.details()}")
        except (asyncio.TimeoutError, RuntimeError) as e:
            node.mark_down(str(e) or type(e).__name__)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.check_all()

    async def _sample(self) -> None:
        loop = asyncio.get_running_loop()
        async with aiohttp.ClientSession() as http:
            next_tick = loop.time()
            while True:
                tick = time.time()  # one time for every node of the tick: the page sums them per tick
                # at least _SAMPLE_TIMEOUT_S: a planner's short interval must not fail every sample of a busy node
                await asyncio.gather(*(n.sample_metrics(http, tick, max(self.sample_s / 2, _SAMPLE_TIMEOUT_S))
                                       for n in self.nodes() if n.healthy))
                next_tick += self.sample_s
                await asyncio.sleep(max(0.0, next_tick - loop.time()))

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())
        self._sampler = asyncio.create_task(self._sample())

    async def stop(self) -> None:
        for task in (self._task, self._sampler):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
