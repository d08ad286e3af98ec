"""KV hand-off through a pdserve kvstore (file:// or redis://), layer by layer in the background.

Worker half: `_start_loads` gives every (request, layer) read its own future and lets up to
io_threads readers on the store's I/O pool take them in layer order, and each read's chunk rows
go into paged memory through the transfer `make_kv_transfer` picks for the engine's device
(connectors/staging.py: `DirectTransfer` on CPU; pinned buffers, a copy stream and one event per
layer on CUDA). A layer-wise load (ChunkedConnector decides which) is waited for
right before each layer's attention, so reads overlap compute; a background load is polled
between steps while its request waits, and the compute stream waits for its copies' events
once it is done. Saves gather a layer's complete chunks right after the layer wrote its KV
and put them in the background; once every layer's put is done the chunks are committed,
still in the background. Every store failure turns into "recompute" (loads) or a warning
(saves), never a failed request or a hang (docs/architecture.md, Invariants).

Parallel layouts (kvstore/layout.py): the connector of each rank is given its `KVShard` (its layers
and KV heads; the argument, or `runner.kv_shard`, default: everything) and saves and loads only
those. Layer indices are the model's (global); `register_kv_caches` takes the rank's own layers'
caches (or every layer's). Where a load's rows land in them is `PagedCaches`' (connectors/store_load.py);
a chunk saved by another layout, or with a codec, is read by the `DecodedLoads` the connector holds
(connectors/decoded_loads.py).
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from pdserve.common.hashing import chunk_keys
from pdserve.connectors.chunk_math import chunk_bounds, hit_tokens
from pdserve.connectors.chunked import (ChunkedConnector, ChunkedConnectorMetadata, InFlightLoad, LoadSpec, PendingSave,
                                SaveSpec)
from pdserve.connectors.decoded_loads import DecodedLoads
from pdserve.connectors.staging import HostChunks, make_kv_transfer
from pdserve.connectors.store_load import PagedCaches, StoreLoad
from pdserve.engine.config import KVRole
from pdserve.kvstore import CorruptObject, KVStore, NotFound, StoreTimeout, StoreUnavailable, open_store
from pdserve.kvstore.layout import KVShard, WriterLayout

if TYPE_CHECKING:
    from pdserve.connectors.staging import ReadTarget
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.request import Request

logger = logging.getLogger(__name__)

_REASONS = ((StoreUnavailable, "unavailable"), (StoreTimeout, "timeout"), (CorruptObject, "corrupt"),
            (NotFound, "missing"))


@dataclass
class _Save:
    spec: SaveSpec
    keys: list[str]
    slots: torch.Tensor  # spec.slots on the engine's device
    futures: list[concurrent.futures.Future] = field(default_factory=list)
    num_bytes: int = 0
    io_seconds: float = 0.0  # gather + put + commit time (puts overlap compute, so not wall time)


class StoreConnector(ChunkedConnector):
    """The pdserve kvstore connector: docs/architecture.md's invariants and arithmetic over open_store(url)."""

    def __init__(self, config: EngineConfig, runner: Any, store: KVStore | None = None,
                 shard: KVShard | None = None) -> None:
        kt = config.kv_transfer
        super().__init__(KVRole(kt.kv_role or KVRole.BOTH), kt.chunk_size, config.cache.block_size,
                         kt.load_timeout_s, kt.save_timeout_s)
        shard = shard or getattr(runner, "kv_shard", None) or KVShard()
        self.num_layers: int = shard.num_layers or runner.num_layers  # the model's, every rank's alike
        self.num_kv_heads: int = shard.num_kv_heads or runner.num_kv_heads
        self.shard = shard.resolve(self.num_layers, self.num_kv_heads)
        self.layout = self.shard.layout(self.num_layers)  # the grid this node writes with
        self.heads = self.shard.heads_range
        self.layers = self.shard.layer_range  # the layers this rank saves and loads
        self.fingerprint: str = runner.fingerprint
        self.store = store or open_store(kt.kv_store, fingerprint=runner.fingerprint, num_layers=self.num_layers,
                                         dtype=runner.dtype, kv_shape=(self.num_kv_heads, runner.head_dim),
                                         timeout=min(kt.load_timeout_s, 5.0))
        # a bound too small for this node's chunks (kvstore/fs_space.py): refused, or one warning saying what to set
        if store is None and (small := self.store.capacity_warning(
                self.chunk_size, getattr(runner, "max_model_len", None) or self.chunk_size)):
            logger.warning(small)
        self.transfer = make_kv_transfer(runner.platform)
        # this rank's caches and where loads land in them; the loads of coded or other-layout chunks
        self.paged_caches = PagedCaches(self.transfer, self.block_size, runner.dtype,
                                  (self.heads[1] - self.heads[0], runner.head_dim))
        self.decoded_loads = DecodedLoads(self.store, self.paged_caches, self.heads, self.num_kv_heads)
        self._saves: dict[str, _Save] = {}
        self._keys: dict[str, list[str]] = {}  # request id -> its prompt's chunk keys
        self.on_commit: Callable[[list[str]], None] | None = None  # told each commit's keys (serving/kv_events.py)

    @property
    def kv_caches(self) -> list[torch.Tensor | None]:
        """The registered caches, by the model's layer index (None before this rank's first layer)."""
        return self.paged_caches.kv_caches

    def keys_for(self, token_ids: list[int], cache_salt: str | None,
                 lora_fingerprint: str | None = None) -> list[str]:
        """The chain of the model, tenant and LoRA adapter: KV of one adapter is never another's hit."""
        return chunk_keys(self.fingerprint, token_ids, self.chunk_size, cache_salt, lora_fingerprint)

    def _prompt_keys(self, request_id: str, token_ids: list[int], cache_salt: str | None,
                     lora_fingerprint: str | None) -> list[str]:
        """Keys of every chunk of a prompt, hashed once per request: the lookup, the load and each
        chunked-prefill save take slices (a chain's prefix keys do not depend on the tokens after them)."""
        keys = self._keys.get(request_id)
        if keys is None:
            keys = self._keys[request_id] = self.keys_for(token_ids, cache_salt, lora_fingerprint)
        return keys

    # ---- scheduler side ----
    def start_lookup(self, request: Request) -> concurrent.futures.Future:
        return self.store.submit(self._hit, list(request.prompt_token_ids), request.cache_salt,
                                 request.lora_fingerprint)

    def _hit(self, token_ids: list[int], cache_salt: str | None, lora_fingerprint: str | None = None) -> int:
        """Hash the prompt's chunk keys and ask the store (on an I/O thread: both take time; the keys are
        not cached, a routing probe's lookup has no request to forget them with)."""
        return hit_tokens(self.store.lookup(self.keys_for(token_ids, cache_salt, lora_fingerprint)), len(token_ids),
                          self.chunk_size)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._keys.pop(request.request_id, None)
        return super().request_finished(request, block_ids)

    def _failure_reason(self, exc: BaseException) -> str:
        if isinstance(exc, concurrent.futures.TimeoutError):
            return f"timeout: no answer within {self.load_timeout_s:g}s"
        kind = next((name for cls, name in _REASONS if isinstance(exc, cls)), "error")
        return f"{kind}: {exc}"

    # ---- worker side: loads ----
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """This rank's layers' caches, in layer order (or every layer's: then indexed by layer)."""
        if len(kv_caches) not in (len(self.layers), self.num_layers):
            raise ValueError(f"{len(kv_caches)} KV caches for layers [{self.layers.start}, {self.layers.stop}) "
                             f"of {self.num_layers}")
        offset = self.layers.start if len(kv_caches) == len(self.layers) else 0
        self.paged_caches.register([None] * offset + list(kv_caches), self.layers)  # by the model's layer index

    def _start_loads(self, specs: list[LoadSpec]) -> list[InFlightLoad]:
        loads = []
        for spec in specs:
            keys = self._prompt_keys(spec.request_id, spec.token_ids, spec.cache_salt, spec.lora_fingerprint)
            plan = spec.plan
            bounds = [chunk_bounds(idx, plan.num_tokens, self.chunk_size) for idx in plan.chunk_range]
            load = StoreLoad(spec, keys=keys[plan.chunk_range.start:plan.chunk_range.stop],
                             chunk_lens=[end - start for start, end in bounds])
            load.layouts = self.store.cached_layouts(load.keys)
            load.whole = load.layouts is None or self._whole(load.layouts)
            load.coded = load.layouts is not None and _coded(load.layouts)
            self.paged_caches.prepare(load)
            loads.append(load)
        self.transfer.begin_step()
        # Layer-major, so layer 0 of every request arrives first. One future per (load, layer), resolved
        # by a few readers on the store's I/O threads that each take the next pair until none is left:
        # a pool task per pair cost a queue round trip and a thread wake-up each (12 per 12-layer load).
        work = [(load, layer) for layer in self.layers for load in loads]
        for load, layer in work:
            load.futures[layer] = concurrent.futures.Future()
        pending, lock = iter(work), threading.Lock()
        for _ in range(min(self.store.io_threads, len(work))):
            self.store.submit(self._read_layers, pending, lock)
        return loads

    def _read_layers(self, pending: Iterator[tuple[StoreLoad, int]], lock: threading.Lock) -> None:
        """Read (load, layer) pairs from `pending` until it is empty, resolving each pair's future as a
        pool task would: skipped if it was cancelled before it started (a failed load), else its bytes
        read or its exception."""
        while True:
            with lock:
                item = next(pending, None)
            if item is None:
                return
            load, layer = item
            future = load.futures[layer]
            if not future.set_running_or_notify_cancel():
                continue
            try:
                nbytes = self._load_layer(load, layer)
            except BaseException as exc:  # noqa: BLE001 (the future carries it to the engine thread)
                future.set_exception(exc)
            else:
                future.set_result(nbytes)

    def _load_layer(self, load: StoreLoad, layer: int) -> int:
        """Read one layer's chunks and write the rows of tokens [N, N + need) into their slots; the bytes
        read. The copy's event (end of the write into paged memory) goes to `load.events[layer]`."""
        if load.failed:  # an earlier layer already failed: the request recomputes, skip the read
            return 0
        if load.layouts is None:
            # The first layer read asks the markers, the others wait for it; not under load.lock, which the
            # engine thread takes to cancel a load and must never wait for the store.
            with load.layouts_lock:
                if load.layouts is None:
                    load.layouts = self.store.layouts(load.keys)
                    load.whole, load.coded = self._whole(load.layouts), _coded(load.layouts)
        if not load.whole:
            return self.decoded_loads.read_parts(load, layer)
        if load.coded:
            return self.decoded_loads.read_coded(load, layer)
        heads = self.heads
        if load.direct is not None:  # straight into the blocks, only inside the load's gate
            spans = self.paged_caches.direct_spans(load, layer)
            nbytes = self.store.get_layer_spans(layer, load.keys, spans, load.chunk_lens, load.gate, heads=heads)
            with load.lock:
                load.finished = max(load.finished, time.perf_counter())
            return nbytes
        target: ReadTarget = self.paged_caches.read_target(load)
        try:  # a chunk holding another number of tokens than its bounds say is CorruptObject
            nbytes = self.store.get_layer_into(layer, load.keys, target.full, target.chunk_lens, heads=heads)
        except BaseException:
            self.paged_caches.hand_back(load, layer, target)
            raise
        self.paged_caches.scatter(load, layer, target)
        return nbytes

    def _whole(self, layouts: list[WriterLayout]) -> bool:
        """Whether every chunk has an object of exactly this rank's heads (the whole-object read: raw, or
        coded through connectors/decoded_loads.py)."""
        want = [(self.heads, self.heads)]
        return all(layout.reads(self.heads, self.num_kv_heads) == want for layout in layouts)

    def wait_for_layer_load(self, layer_idx: int) -> None:
        """Layer-wise loads only (background loads are polled by get_finished), bounded by their deadline."""
        for load in self._loads:
            future = load.futures.get(layer_idx)
            if load.failed or future is None:
                continue
            try:
                future.result(timeout=max(0.0, load.deadline - time.monotonic()))
            except Exception as exc:  # timeout, store error or a bad object: recompute this request
                self._fail_load(load, exc)
                continue
            event = load.events.get(layer_idx)
            if event is not None:  # the compute stream waits for this layer's copy, the host does not
                self.transfer.wait(event)
            if layer_idx == self.layers.stop - 1:
                self._settle_load(load)

    def _settle_load(self, load: InFlightLoad) -> bool:
        ok = super()._settle_load(load)
        if ok:  # a background load: the compute stream waits for all its copies before the request runs
            for event in load.events.values():
                if event is not None:
                    self.transfer.wait(event)
        return ok

    def _load_codec(self, load: InFlightLoad) -> str | None:
        codecs = load.codecs if isinstance(load, StoreLoad) else None
        return "+".join(sorted(codecs)) if codecs else "raw"

    def _fail_load(self, load: InFlightLoad, exc: BaseException) -> None:
        super()._fail_load(load, exc)  # no copy is issued for it from now on
        self.transfer.fence()  # and those issued before land before the engine recomputes the blocks
        if isinstance(exc, (CorruptObject, NotFound)) and isinstance(load, StoreLoad):
            # a committed chunk is damaged: un-commit it (kvstore/admin.py, repair) or every later prefill
            # skips it and every decode recomputes; on the I/O pool, the engine thread does not wait
            self.store.submit(self.store.repair, list(load.keys))

    # ---- worker side: saves ----
    def save_kv_layer(self, layer_idx: int, kv_cache: torch.Tensor, metadata: ChunkedConnectorMetadata) -> None:
        if not self.shard.writes:  # a replica rank: the rank holding the same heads saves them
            return
        for spec in metadata.saves:
            if spec.request_id in self._failed:
                continue
            started = time.perf_counter()
            save = self._saves.get(spec.request_id)
            if save is None:
                keys = self._prompt_keys(spec.request_id, spec.token_ids, spec.cache_salt, spec.lora_fingerprint)
                first = spec.start // self.chunk_size
                save = self._saves[spec.request_id] = _Save(spec, keys[first:-(-spec.end // self.chunk_size)],
                                                            self.transfer.device_slots(spec.slots))
            # Contiguous host copies, so later steps may reuse the blocks (on CUDA: a side-stream copy).
            chunk_lens = [min(self.chunk_size, spec.end - spec.start - i * self.chunk_size)
                          for i in range(len(save.keys))]
            host = self.transfer.save(kv_cache, save.slots, chunk_lens)
            save.num_bytes += sum(c.nbytes for c in host.tensors)
            save.io_seconds += time.perf_counter() - started
            save.futures.append(self.store.submit(self._put_layer, layer_idx, save.keys, host))

    def _put_layer(self, layer: int, keys: list[str], host: HostChunks) -> float:
        started = time.perf_counter()
        try:
            host.ready.synchronize()  # the device->host copy of these chunks has landed
            self.store.put_layer(layer, dict(zip(keys, host.tensors)), heads=self.heads)
        finally:
            self.transfer.release(host)
        return time.perf_counter() - started

    def wait_for_save(self) -> None:
        """Hand this step's saves to the background: each commits once all its layers are written."""
        saves, self._saves = self._saves, {}
        step = list(self._step_saves)
        dropped = self._drop_saves_of_failed_loads()
        for rid in dropped:
            saves.pop(rid, None)
        for save in saves.values():
            self._commit_when_written(save, self._track_save(save.spec))
        if not self.shard.writes:  # a replica: the rank holding the same heads saves them, nothing to wait for
            for spec in step:
                if spec.request_id not in dropped and spec.request_id not in self._failed:
                    self._track_save(spec).done.set_result((0, 0, 0.0))

    def _commit_when_written(self, save: _Save, pending: PendingSave) -> None:
        """Resolve `pending.done` after the last put: commit (on an I/O thread) unless a put failed or
        the save was abandoned meanwhile. Callbacks, not a waiting thread: no pool thread blocks."""
        if len(save.futures) != len(self.layers):
            pending.done.set_exception(NotFound(f"only {len(save.futures)} of {len(self.layers)} layers were written"))
            return
        left = [len(save.futures)]
        lock = threading.Lock()

        def on_put(_: concurrent.futures.Future) -> None:
            with lock:
                left[0] -= 1
                if left[0]:
                    return
            try:
                save.io_seconds += sum(future.result() for future in save.futures)
                if pending.abandoned:
                    raise StoreTimeout(f"not committed within {self.save_timeout_s:g}s")
                commit = self.store.submit(self._commit, save, pending)
            except Exception as exc:
                pending.done.set_exception(exc)
                return
            commit.add_done_callback(lambda f: _resolve(pending.done, f))

        for future in save.futures:
            future.add_done_callback(on_put)

    def _commit(self, save: _Save, pending: PendingSave) -> tuple[int, int, float]:
        if pending.abandoned:
            raise StoreTimeout(f"not committed within {self.save_timeout_s:g}s")
        started = time.perf_counter()
        self.store.commit(save.keys, layout=self.layout, part=self.layout.part_index(self.shard.layers, self.heads))
        save.io_seconds += time.perf_counter() - started
        if self.on_commit is not None:
            self.on_commit(save.keys)
        return len(save.keys), save.num_bytes, save.io_seconds

    def shutdown(self) -> None:
        self.store.close()


def _coded(layouts: list[WriterLayout]) -> bool:
    return any(layout.codec != "raw" for layout in layouts)


def _resolve(target: concurrent.futures.Future, source: concurrent.futures.Future) -> None:
    """Copy a finished future's outcome into another."""
    error = source.exception() if not source.cancelled() else concurrent.futures.CancelledError()
    if error is not None:
        target.set_exception(error)
    else:
        target.set_result(source.result())
