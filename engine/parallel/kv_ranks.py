"""The KV connector across ranks: every rank's connector saves and loads its own part (its KVShard), rank 0's
scheduler sees one connector (docs/parallelism.md, "The engine's side of the hand-off").

Rank 0 wraps its connector in `RankConnector`. Each step the other ranks receive the requests rank 0's
scheduler finished since the last step (their connectors' `request_finished` closes a background load's
write gate before rank 0 reuses the blocks) and the connector metadata; after the step each rank reports
its finished saves and loads and its failed loads. Rank 0 then reports to its scheduler
- a failed load when any rank's failed (a background load's failure once every rank's load ended);
- a background load finished once every rank's has;
- a finished request's save done once every rank that was saving it is done (the scheduler is always
  told to hold a finished request of a saving node until then: a prefill reply means every part is
  committed).
On a node that both loads and saves (kv_both), the ranks also share their failed loads after each computing
step and before its saves (`share_failed_loads`): a rank whose own load succeeded computed its part over the
failing rank's missing KV, so no rank commits that step's saves of the request; they are redone after the
recompute, as a single process does.
Every rank's loads and saves come to rank 0 with the same reports, and rank 0 writes one load and save line
per request with every rank's bytes (kv_events.py).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from pdserve.engine.kv_connector import KVConnectorBase, KVConnectorMetadata
from pdserve.engine.parallel import meta_codec
from pdserve.engine.parallel.group import RankGroup
from pdserve.engine.parallel.kv_events import KVTransfer, KVTransferJoin
from pdserve.engine.parallel.layout import ParallelLayout
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams


def send_bytes(group: RankGroup, data: bytes, dst: int) -> None:
    group.send(torch.tensor([len(data)], dtype=torch.int64), dst)
    if data:
        group.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst)


def recv_bytes(group: RankGroup, src: int) -> bytes:
    n = int(group.recv(torch.empty(1, dtype=torch.int64), src).item())
    return bytes(group.recv(torch.empty(n, dtype=torch.uint8), src).numpy()) if n else b""


def broadcast_bytes(group: RankGroup, data: bytes | None, size: int) -> bytes:
    """Rank 0 passes `data`, the others None and the size from the header."""
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data is not None else \
        torch.empty(size, dtype=torch.uint8)
    return bytes(group.broadcast(t).numpy())


def share_failed_loads(group: RankGroup, own: set[str]) -> set[str]:
    """Every rank's failed loads of this step, on every rank: the other ranks send theirs to rank 0, which
    broadcasts the union. All ranks call it at the same point of a computing step."""
    rank = group.layout.rank
    if rank != 0:
        send_bytes(group, json.dumps(sorted(own)).encode(), 0)
        size = int(group.broadcast(torch.empty(1, dtype=torch.int64)).item())
        return set(json.loads(broadcast_bytes(group, None, size)))
    union = set(own)
    for other in range(1, group.layout.world_size):
        union |= set(json.loads(recv_bytes(group, other)))
    data = json.dumps(sorted(union)).encode()
    group.broadcast(torch.tensor([len(data)], dtype=torch.int64))
    broadcast_bytes(group, data, len(data))
    return union


def _shares_failed_loads(connector: KVConnectorBase) -> bool:
    """A node that loads and saves in one engine (kv_both): a save can follow another rank's failed load."""
    return connector.role.loads and connector.role.saves and hasattr(connector, "loads_failed_elsewhere")


class WorkerKV:
    """A rank other than 0: its own connector, driven by what rank 0 sends."""

    def __init__(self, connector: KVConnectorBase, group: RankGroup) -> None:
        self.connector, self.group = connector, group
        self._events: list[KVTransfer] = []  # this rank's loads and saves, for rank 0's lines
        metrics = getattr(connector, "metrics", None)
        if metrics is not None:
            metrics.sink = self._events.append

    def begin(self, message: bytes) -> tuple[list[str], Any, list[str]]:
        """Finish the requests rank 0 finished, start this step's loads: (finished, metadata, delayed)."""
        body = json.loads(message)
        finished = body["finished"]
        delayed = [rid for rid in finished
                   if self.connector.request_finished(Request(rid, [], SamplingParams()), [])[0]]
        meta = meta_codec.decode(body["meta"].encode())
        self.connector.start_load_kv(meta)
        return finished, meta, delayed

    def end(self, finished: list[str], delayed: list[str], computed: bool = True) -> bytes:
        """After the forward pass (`computed`) or a step that computed nothing: hand the saves over and report
        what this rank's I/O finished."""
        c = self.connector
        if computed and _shares_failed_loads(c):
            own = c.failed_load_ids()
            c.loads_failed_elsewhere(share_failed_loads(self.group, own) - own)
        c.wait_for_save()
        sending, recving = c.get_finished(set(finished))
        failed = c.get_failed_loads()
        events, self._events[:] = list(self._events), []
        return json.dumps({"delayed": delayed, "sending": sorted(sending or ()), "recving": sorted(recving or ()),
                           "failed": sorted(failed), "events": [e.to_json() for e in events]}).encode()


class RankConnector(KVConnectorBase):
    """Rank 0's connector as its scheduler and model runner see it: its own connector plus the other ranks'."""

    def __init__(self, inner: KVConnectorBase, layout: ParallelLayout, send_connector_step: Callable[[bytes], None],
                 collect_reports: Callable[[], list[bytes]],
                 share_failures: Callable[[set[str]], set[str]]) -> None:
        super().__init__(inner.role)
        self.inner, self.world = inner, layout.world_size
        self._send_connector_step, self._collect = send_connector_step, collect_reports
        self._share_failures = share_failures if _shares_failed_loads(inner) else None
        self._finished: list[str] = []  # told to the other ranks with the next step
        self._told: list[str] = []  # finished requests told this step: their loads' parts are all in after it
        self._saving: dict[str, set[int]] = {}  # finished request -> ranks still saving it
        self._loaded: dict[str, set[int]] = {}  # background load -> ranks whose load ended
        self._held_failures: set[str] = set()  # background loads failed somewhere, until every rank's ended
        self._failed: set[str] = set()
        self._message: bytes | None = None
        self._sent = False
        self._events: list[KVTransfer] = []  # rank 0's own loads and saves, joined with the other ranks'
        self.join: KVTransferJoin | None = None
        metrics = getattr(inner, "metrics", None)
        if metrics is not None:
            writers = [r for r in range(self.world) if ParallelLayout(layout.tp, layout.pp, r, layout.dims).kv_writer]
            self.join = KVTransferJoin(self.world, writers, metrics.write, getattr(inner, "load_timeout_s", 10.0),
                                       getattr(inner, "save_timeout_s", 10.0))
            metrics.sink = self._events.append

    def __getattr__(self, name: str) -> Any:  # the connector's own figures (metrics, stores) stay reachable
        return getattr(self.inner, name)

    # ---- scheduler side ----
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.inner.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        self.inner.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self.inner.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        delay, params = self.inner.request_finished(request, block_ids)
        rid = request.request_id
        self._finished.append(rid)
        if not self.role.saves:
            return delay, params
        self._saving[rid] = {0} if delay else set()
        return True, params

    # ---- worker side ----
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self.inner.register_kv_caches(kv_caches)

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        self.inner.start_load_kv(metadata)
        finished, self._finished = self._finished, []  # the other ranks' delays for them come with the reports
        self._told += finished
        self._message = json.dumps({"finished": finished, "meta": meta_codec.encode(metadata).decode()}).encode()
        self._sent = False

    def step_message(self) -> bytes:
        """What the other ranks' connectors need this step (sent with the STEP command)."""
        assert self._message is not None, "start_load_kv comes first"
        self._sent = True
        return self._message

    def wait_for_layer_load(self, layer_idx: int) -> None:
        self.inner.wait_for_layer_load(layer_idx)

    def save_kv_layer(self, layer_idx: int, kv_cache: torch.Tensor, metadata: KVConnectorMetadata) -> None:
        self.inner.save_kv_layer(layer_idx, kv_cache, metadata)

    def wait_for_save(self) -> None:
        if self._sent and self._share_failures is not None:  # a computing step: every rank is here too
            own = self.inner.failed_load_ids()
            self.inner.loads_failed_elsewhere(self._share_failures(own) - own)
        self.inner.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if not self._sent:  # a step that computed nothing: the other ranks' I/O moves too
            self._send_connector_step(self.step_message())
        sending0, recving0 = self.inner.get_finished(finished_req_ids)
        own, self._events[:] = list(self._events), []
        reports = [{"delayed": [], "sending": sorted(sending0 or ()), "recving": sorted(recving0 or ()),
                    "failed": sorted(self.inner.get_failed_loads())}]
        reports += [json.loads(r) for r in self._collect()]
        for rank, report in enumerate(reports):
            if self.join is not None:
                for event in own if rank == 0 else map(KVTransfer.from_json, report["events"]):
                    self.join.add(rank, event)
                for rid in report["failed"]:
                    self.join.load_failed(rank, rid)
            for rid in report["delayed"]:
                if rid in self._saving:
                    self._saving[rid].add(rank)
            for rid in report["sending"]:
                self._saving.get(rid, set()).discard(rank)
            for rid in report["recving"]:
                self._loaded.setdefault(rid, set()).add(rank)
            for rid in report["failed"]:
                (self._held_failures if rid in report["recving"] else self._failed).add(rid)
        sending = {rid for rid, ranks in self._saving.items() if not ranks}
        for rid in sending:
            del self._saving[rid]
        recving = {rid for rid, ranks in self._loaded.items() if len(ranks) == self.world}
        for rid in recving:
            del self._loaded[rid]
        self._failed |= self._held_failures & recving
        self._held_failures -= recving
        if self.join is not None:  # parts that have not come by now never will
            told, self._told = self._told, []
            for rid in recving | set(told):
                self.join.settle_load(rid)
            for rid in sending:
                self.join.settle_saves(rid)
            self.join.end_round()
        return sending, recving

    def get_failed_loads(self) -> set[str]:
        failed, self._failed = self._failed, set()
        return failed

    def shutdown(self) -> None:
        self.inner.shutdown()
