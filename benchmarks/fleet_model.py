"""The discrete-event model under benchmarks/fleet_sim.py: simulated prefill/decode nodes around the REAL proxy objects.

What is real: `pdserve.proxy.router.Router` (its `rank()`, called as pd-proxy calls it, with a LookupRequest of the
prompt's token ids), `pdserve.proxy.kv_index.KVIndex` (fed the batches the nodes' publisher would write:
serving/kv_events.py's format, one per node per 50 ms of simulated time), `pdserve.proxy.health.NodeLoad` (the load
score the policies sort by) and `pdserve.common.hashing.chunk_keys`. What is simulated: the nodes. Each holds a
prefix cache (an LRU of full chunk keys, `kv_tokens` of capacity) and takes time from a `Profile`:
  prefill   FIFO, whole requests batched up to 4096 computed tokens; a request costs
            (prompt - cached prefix) / prefill_tok_s * (1 + mean context / prefill_ctx_tokens)
  hand-off  handoff_ms_per_token * prompt tokens (the decode side loading the KV), then the first token is out
  decode    continuous batching (at most max_batch running and kv_tokens of context); one step costs
            decode_base_ms + decode_per_seq_ms * batch + decode_per_ctx_token_ms * context tokens in the batch
The lookup policy (no index) runs the same Router over fake `Lookup` stubs answering from each node's cache at the
moment of the call: today's per-request lookups with perfect, fresh answers. The index's routing cost is timed with
the garbage collector off for the call (a collection's pause scales with the simulation's own heap, not the proxy's).
Roles can move (a planner's switch: `move()`): the node leaves its router, drains, and joins the other after
`switch_s`, its prefix cache kept.
"""
from __future__ import annotations

import asyncio
import gc
import heapq
import json
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

from pdserve.common.hashing import chunk_keys
from pdserve.protos import pdserve_pb2 as pb
from pdserve.proxy.health import NodeLoad
from pdserve.proxy.kv_index import KVIndex
from pdserve.proxy.router import Router

from fleet_traces import TraceRequest

FP = "5e" * 16  # the fleet's model fingerprint
CHUNK = 256  # --chunk-size's default (engine/config.py)
FLUSH_S = 0.05  # the publisher's batching interval


@dataclass
class Profile:
    """Step times of one node. The defaults: docs/benchmarks.md's figures for the bench model on a 2-core Zen 4
    (recompute of 2k tokens 1646 ms; a decode step of batch 16 at ~600 tokens of context 22.7 ms, of batch 1
    8.9 ms; the file store's hand-off of 2k tokens 22 ms), a 4 GB KV budget of that model."""
    prefill_tok_s: float = 1400.0
    prefill_ctx_tokens: float = 8000.0
    decode_base_ms: float = 7.5
    decode_per_seq_ms: float = 0.55
    decode_per_ctx_token_ms: float = 0.0008
    handoff_ms_per_token: float = 0.011
    kv_tokens: int = 65536
    max_batch: int = 64
    source: str = "default: docs/benchmarks.md figures (bench model, 2-core Zen 4)"

    @classmethod
    def load(cls, path: str | None) -> "Profile":
        if path is None:
            return cls()
        data = json.loads(Path(path).read_text())
        data.setdefault("source", f"measured: {path}")
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})

    def prefill_s(self, prompt: int, cached: int) -> float:
        return (prompt - cached) / self.prefill_tok_s * (1 + (prompt + cached) / 2 / self.prefill_ctx_tokens)

    def step_s(self, batch: int, context: int) -> float:
        return (self.decode_base_ms + self.decode_per_seq_ms * batch + self.decode_per_ctx_token_ms * context) / 1e3

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Flight:
    """One request in the simulation."""
    req: TraceRequest
    keys: list[str]  # the prompt's full chunks' keys
    cached: int = 0  # prompt tokens the prefill node found in its cache
    first_s: float = 0.0
    done_s: float = 0.0
    made: int = 0


class SimNode:
    """What Router reads of a node (address, healthy, load, stub) plus the simulated engine behind it."""

    def __init__(self, address: str, role: str, profile: Profile) -> None:
        self.address, self.role, self.healthy, self.load = address, role, True, NodeLoad()
        self.profile = profile
        self.cache: OrderedDict[str, None] = OrderedDict()
        self.capacity = profile.kv_tokens // CHUNK
        self.pending: list[tuple[str, list[str]]] = []  # KV events not yet published
        self.seq = 0
        self.queue: list[Flight] = []  # prefill: waiting; decode: waiting to join the batch
        self.running: list[Flight] = []
        self.busy = False
        self.stub = SimpleNamespace(Lookup=self._lookup)
        self.asked: list[str] = []  # the keys a fake Lookup answers for (set by the simulator per request)
        self.samples: list[tuple[float, float]] = []  # (when, seconds): a prefill's TTFT, a decode's token gaps

    async def _lookup(self, lookup: pb.LookupRequest, timeout: float) -> SimpleNamespace:
        return SimpleNamespace(local_hit_tokens=self.cached_prefix(self.asked) * CHUNK, store_hit_tokens=0)

    def cached_prefix(self, keys: list[str]) -> int:
        n = 0
        for key in keys:
            if key not in self.cache:
                break
            n += 1
        return n

    def insert(self, keys: list[str]) -> None:
        stored: list[str] = []
        for key in keys:
            if key in self.cache:
                self.cache.move_to_end(key)
            else:
                self.cache[key] = None
                stored.append(key)
        removed = [self.cache.popitem(last=False)[0] for _ in range(max(0, len(self.cache) - self.capacity))]
        if stored:
            self.pending.append(("stored", stored))
        if removed:
            self.pending.append(("removed", removed))

    def batch(self, kind: str | None = None, keys: list[str] | None = None) -> dict[str, Any]:
        """The stream entry its publisher would write now (serving/kv_events.py's format)."""
        self.seq += 1
        events = [("snapshot", [])] if kind is None else self.pending
        self.pending = []
        return {"v": 1, "node": self.address, "boot": "b0", "seq": self.seq, "fp": FP, "chunk": CHUNK,
                "events": [{"kind": k, "keys": ks} for k, ks in events]}


def run_sync(coro: Any) -> Any:
    """Run a coroutine that never suspends (Router.rank over the index with token ids) without an event loop."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("the ranking suspended: it needs an event loop")


@dataclass
class Result:
    flights: list[Flight]
    route_ns: list[int]
    index: KVIndex | None
    duration: float
    roles: list[tuple[float, int]] = field(default_factory=list)  # (time, prefill nodes) as the planner moved them


class Simulator:
    """One run: a trace through n_prefill + n_decode simulated nodes, routed by the real Router.
    policy: "index" (kv-aware over a KVIndex fed by events), "lookup" (kv-aware over fake Lookup RPCs) or
    "least-loaded". `on_tick(sim, now)`, if given, runs every `tick_s` (a planner's hook: it may call move())."""

    def __init__(self, profile: Profile, n_prefill: int, n_decode: int, policy: str = "index",
                 on_tick: Callable[["Simulator", float], None] | None = None, tick_s: float = 5.0,
                 switch_s: float = 10.0) -> None:
        self.profile, self.policy = profile, policy
        self.nodes = [SimNode(f"10.0.{i // 250}.{i % 250}:50051", "prefill" if i < n_prefill else "decode", profile)
                      for i in range(n_prefill + n_decode)]
        self.index = KVIndex() if policy == "index" else None
        kv_policy = "least-loaded" if policy == "least-loaded" else "kv-aware"
        self.prefill = Router([n for n in self.nodes if n.role == "prefill"], kv_policy, index=self.index)
        self.decode = Router([n for n in self.nodes if n.role == "decode"], "least-loaded")  # type: ignore[list-item]
        self.on_tick, self.tick_s, self.switch_s = on_tick, tick_s, switch_s
        self.track = on_tick is not None  # keep the nodes' latency samples (what a planner reads)
        self._events: list[tuple[float, int, str, Any]] = []
        self._n = 0
        self._dirty: set[SimNode] = set()
        self._loop = asyncio.new_event_loop() if policy == "lookup" else None
        self.route_ns: list[int] = []
        self.roles: list[tuple[float, int]] = []
        self.now = 0.0
        if self.index is not None:
            for n in self.nodes:
                self.index.apply(n.batch())

    def _at(self, t: float, kind: str, what: Any = None) -> None:
        self._n += 1
        heapq.heappush(self._events, (t, self._n, kind, what))

    def run(self, trace: list[TraceRequest]) -> Result:
        for r in trace:
            self._at(r.t, "arrive", r)
        end = trace[-1].t if trace else 0.0
        if self.index is not None:
            self._at(FLUSH_S, "flush")
        if self.on_tick is not None:
            self._at(self.tick_s, "tick")
        flights: list[Flight] = []
        while self._events:
            self.now, _, kind, what = heapq.heappop(self._events)
            if kind == "arrive":
                flights.append(self._arrive(what))
            elif kind == "prefilled":
                self._prefilled(*what)
            elif kind == "handed":
                self._join_decode(what)
            elif kind == "step":
                self._stepped(what)
            elif kind == "switch":
                self._switched(what)
            elif kind == "flush":
                for node in self._dirty:
                    self.index.apply(node.batch("events"))  # type: ignore[union-attr]
                self._dirty.clear()
                if self.now < end or len(self._events) > 0:
                    self._at(self.now + FLUSH_S, "flush")
            elif kind == "tick" and self.now < end:
                self.on_tick(self, self.now)  # type: ignore[misc]
                self._at(self.now + self.tick_s, "tick")
        if self._loop is not None:
            self._loop.close()
        return Result(flights, self.route_ns, self.index, end, self.roles)

    def time_rank(self, req: TraceRequest, repeats: int) -> int:
        """The prefill router's ranking of `req` against the index as it is now: the best of `repeats` calls, ns."""
        lookup = pb.LookupRequest(prompt=pb.Prompt(token_ids=pb.TokenIds(ids=req.ids())))
        best = None
        for _ in range(repeats):
            gc.disable()
            t0 = time.perf_counter_ns()
            run_sync(self.prefill.rank(lookup))
            took = time.perf_counter_ns() - t0
            gc.enable()
            best = took if best is None else min(best, took)
        return best or 0

    # ------------------------------------------------------------ prefill
    def _arrive(self, req: TraceRequest) -> Flight:
        ids = req.ids()
        flight = Flight(req, chunk_keys(FP, ids, CHUNK)[:req.prompt_len // CHUNK])
        lookup = pb.LookupRequest(prompt=pb.Prompt(token_ids=pb.TokenIds(ids=ids)))
        if self._loop is not None:
            for n in self.prefill.nodes:
                n.asked = flight.keys  # type: ignore[attr-defined]
            ranked = self._loop.run_until_complete(self.prefill.rank(lookup))
        else:  # the collector off for the call: a pause sized by the simulation's heap is not the router's cost
            gc.disable()
            t0 = time.perf_counter_ns()
            ranked = run_sync(self.prefill.rank(lookup))
            self.route_ns.append(time.perf_counter_ns() - t0)
            gc.enable()
        node: SimNode = ranked[0]
        node.load.in_flight += 1
        node.queue.append(flight)
        if not node.busy:
            self._start_prefill(node)
        return flight

    def _start_prefill(self, node: SimNode) -> None:
        batch, budget, took = [], 4096, 0.0
        while node.queue and (not batch or budget > 0):
            f = node.queue.pop(0)
            f.cached = node.cached_prefix(f.keys) * CHUNK
            node.insert(f.keys[:f.cached // CHUNK])  # the hit's chunks are touched (LRU order)
            budget -= f.req.prompt_len - f.cached
            took += self.profile.prefill_s(f.req.prompt_len, f.cached)
            batch.append(f)
        node.busy = bool(batch)
        if batch:
            self._at(self.now + took, "prefilled", (node, batch))

    def _prefilled(self, node: SimNode, batch: list[Flight]) -> None:
        for f in batch:
            node.insert(f.keys)
            node.load.in_flight -= 1
            if self.track:
                node.samples.append((self.now, self.now - f.req.t))
            f.first_s = self.now + self.profile.handoff_ms_per_token * f.req.prompt_len / 1e3
            f.made = 1
            self._at(f.first_s, "handed", f)
        if node.pending and self.index is not None:
            self._dirty.add(node)
        node.busy = False
        self._after_work(node)

    # ------------------------------------------------------------ decode
    def _join_decode(self, f: Flight) -> None:
        if f.made >= f.req.output:
            f.done_s = self.now
            return
        node: SimNode = run_sync(self.decode.rank())[0]
        node.load.in_flight += 1
        node.queue.append(f)
        if not node.busy:
            self._step(node)

    def _step(self, node: SimNode) -> None:
        context = sum(f.req.prompt_len + f.made for f in node.running)
        while node.queue and len(node.running) < self.profile.max_batch and \
                context + node.queue[0].req.prompt_len + node.queue[0].req.output <= self.profile.kv_tokens:
            f = node.queue.pop(0)
            node.running.append(f)
            if self.track:
                node.samples.append((self.now, self.now - f.first_s))  # the gap before its second token
            context += f.req.prompt_len + f.made
        node.busy = bool(node.running)
        if node.running:
            took = self.profile.step_s(len(node.running), context)
            if self.track:
                node.samples.append((self.now + took, took))
            self._at(self.now + took, "step", node)

    def _stepped(self, node: SimNode) -> None:
        still = []
        for f in node.running:
            f.made += 1
            if f.made >= f.req.output:
                f.done_s = self.now
                node.load.in_flight -= 1
            else:
                still.append(f)
        node.running = still
        node.busy = False
        self._after_work(node)

    # ------------------------------------------------------------ roles (a planner's moves)
    def move(self, node: SimNode) -> None:
        """Take `node` out of its router now; once it has drained and `switch_s` passed, it joins the other role."""
        router = self.prefill if node.role == "prefill" else self.decode
        if node in router.nodes:
            router.nodes.remove(node)
            node.role = "to-" + ("decode" if node.role == "prefill" else "prefill")
            if not node.busy:
                self._at(self.now + self.switch_s, "switch", node)

    def _after_work(self, node: SimNode) -> None:
        if node.role.startswith("to-"):
            if not node.queue and not node.running:
                self._at(self.now + self.switch_s, "switch", node)
                return
        (self._start_prefill if node.role in ("prefill", "to-decode") else self._step)(node)

    def _switched(self, node: SimNode) -> None:
        node.role = node.role[3:]
        (self.prefill if node.role == "prefill" else self.decode).nodes.append(node)  # type: ignore[arg-type]
        self.roles.append((self.now, len(self.prefill.nodes)))


def index_bytes(index: KVIndex) -> int:
    """A sys.getsizeof walk over the index's containers and the strings they hold (keys counted once)."""
    import sys
    seen: set[int] = set()

    def size(obj: Any) -> int:
        if id(obj) in seen:
            return 0
        seen.add(id(obj))
        return sys.getsizeof(obj)

    total = size(index._local) + size(index._store) + size(index.nodes)
    for key, holders in index._local.items():
        total += size(key) + size(holders) + sum(size(h) for h in holders)
    for key in index._store:
        total += size(key)
    for name, entry in index.nodes.items():
        total += size(name) + size(entry) + size(entry.chunks) + sum(size(k) for k in entry.chunks)
    return total
