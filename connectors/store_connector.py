"""KV hand-off through a pdserve kvstore (file:// or redis://), layer by layer in the background.

Worker half: `start_load_kv` queues one read per (request, layer) on the store's I/O pool, in
layer order, and each read's chunk rows go into paged memory through the engine device's
`KVTransfer` (connectors/staging.py: directly on CPU; pinned buffers, a copy stream and one
event per layer on CUDA). The forward pass waits for layer i only right before layer i's
attention, so reads overlap compute. Saves gather a layer's complete chunks right after the
layer wrote its KV and put them in the background; `wait_for_save` commits the chunks once
every layer is written. Every store failure turns into "recompute" (loads) or a warning
(saves), never a failed request or a hang (docs/architecture.md, Invariants).
"""
from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from common.hashing import chunk_keys
from connectors.chunk_math import chunk_bounds, hit_tokens
from connectors.chunked import ChunkedConnector, ChunkedConnectorMetadata, InFlightLoad, SaveSpec
from connectors.staging import HostChunks, make_kv_transfer
from engine.config import KVRole
from kvstore import CorruptObject, KVStore, NotFound, StoreTimeout, StoreUnavailable, open_store

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.request import Request

_REASONS = ((StoreUnavailable, "unavailable"), (StoreTimeout, "timeout"), (CorruptObject, "corrupt"),
            (NotFound, "missing"))


@dataclass
class _Load(InFlightLoad):
    keys: list[str] = field(default_factory=list)
    slots: torch.Tensor | None = None  # spec.slots on the engine's device
    futures: dict[int, concurrent.futures.Future] = field(default_factory=dict)  # layer -> its copy's event


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

    def __init__(self, config: EngineConfig, runner: Any, store: KVStore | None = None) -> None:
        kt = config.kv_transfer
        super().__init__(KVRole(kt.kv_role or KVRole.BOTH), kt.chunk_size, config.cache.block_size)
        self.fingerprint: str = runner.fingerprint
        self.num_layers: int = runner.num_layers
        self.load_timeout_s = kt.load_timeout_s
        self.store = store or open_store(kt.kv_store, fingerprint=runner.fingerprint, num_layers=runner.num_layers,
                                         dtype=runner.dtype, kv_shape=(runner.num_kv_heads, runner.head_dim),
                                         timeout=min(kt.load_timeout_s, 5.0))
        self.kv_caches: list[torch.Tensor] = []
        self.transfer = make_kv_transfer(runner.platform)
        self.dtype: torch.dtype = runner.dtype
        self.kv_shape: tuple[int, int] = (runner.num_kv_heads, runner.head_dim)
        self._loads: list[_Load] = []
        self._load_deadline = 0.0
        self._saves: dict[str, _Save] = {}
        self._keys: dict[str, list[str]] = {}  # request id -> its prompt's chunk keys

    def keys_for(self, token_ids: list[int], cache_salt: str | None) -> list[str]:
        return chunk_keys(self.fingerprint, token_ids, self.chunk_size, cache_salt)

    def _prompt_keys(self, request_id: str, token_ids: list[int], cache_salt: str | None) -> list[str]:
        """Keys of every chunk of a prompt, hashed once per request: the lookup, the load and each
        chunked-prefill save take slices (a chain's prefix keys do not depend on the tokens after them)."""
        keys = self._keys.get(request_id)
        if keys is None:
            keys = self._keys[request_id] = self.keys_for(token_ids, cache_salt)
        return keys

    # ---- scheduler side ----
    def lookup_hit(self, request: Request) -> int:
        keys = self._prompt_keys(request.request_id, request.prompt_token_ids, request.cache_salt)
        present = self.store.result(self.store.submit(self.store.lookup, keys), self.load_timeout_s)
        return hit_tokens(present, request.num_prompt_tokens, self.chunk_size)

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
        self.kv_caches = list(kv_caches)

    def start_load_kv(self, metadata: ChunkedConnectorMetadata) -> None:
        self._loads = []
        self._begin_step(metadata)
        if not metadata.loads:
            return
        self._load_deadline = time.monotonic() + self.load_timeout_s
        for spec in metadata.loads:
            keys = self._prompt_keys(spec.request_id, spec.token_ids, spec.cache_salt)
            self._loads.append(_Load(spec, keys=keys[spec.plan.chunk_range.start:spec.plan.chunk_range.stop],
                                     slots=self.transfer.device_slots(spec.slots)))
        self.transfer.begin_step()
        for layer in range(self.num_layers):  # layer-major, so layer 0 of every request arrives first
            for load in self._loads:
                load.futures[layer] = self.store.submit(self._load_layer, load, layer)

    def _load_layer(self, load: _Load, layer: int) -> tuple[int, Any]:
        """Read one layer's chunks and write the rows of tokens [N, N + need) into their slots.

        Returns (bytes read, the event marking the end of the copy into paged memory)."""
        plan = load.spec.plan
        if load.failed:  # an earlier layer already failed: the request recomputes, skip the read
            return 0, None
        bounds = [chunk_bounds(idx, plan.num_tokens, self.chunk_size) for idx in plan.chunk_range]
        target = self.transfer.read_target([end - start for start, end in bounds], self.kv_shape, self.dtype)
        try:
            tensors = self.store.get_layer(layer, load.keys, out=target.out)
            for idx, (start, end), tensor in zip(plan.chunk_range, bounds, tensors):
                if tensor.shape[1] != end - start:
                    raise CorruptObject(f"chunk {idx} layer {layer} holds {tensor.shape[1]} tokens, "
                                        f"expected {end - start}")
        except BaseException:
            self.transfer.load(self.kv_caches[layer], [], 0, 0, load.slots, target)  # hand the buffer back
            raise
        first = bounds[0][0]  # == plan.aligned_start
        write_start, write_end = plan.write_range
        with load.lock:
            lo, hi = (0, 0) if load.failed else (write_start - first, write_end - first)
            event = self.transfer.load(self.kv_caches[layer], tensors, lo, hi, load.slots, target)
            load.finished = max(load.finished, time.perf_counter())
        return sum(t.nbytes for t in tensors), event

    def wait_for_layer_load(self, layer_idx: int) -> None:
        for load in self._loads:
            future = load.futures.get(layer_idx)
            if load.failed or future is None:
                continue
            try:
                num_bytes, event = future.result(timeout=max(0.0, self._load_deadline - time.monotonic()))
            except Exception as exc:  # timeout, store error or a bad object: recompute this request
                self._fail_load(load, exc)
                self.transfer.fence()  # copies issued before the failure land before the recompute
                continue
            load.num_bytes += num_bytes
            if event is not None:  # the compute stream waits for this layer's copy, the host does not
                self.transfer.wait(event)
            if layer_idx == self.num_layers - 1:
                self.metrics.on_load(load.spec.request_id, load.spec.plan, load.num_bytes, load.io_seconds)

    # ---- worker side: saves ----
    def save_kv_layer(self, layer_idx: int, kv_cache: torch.Tensor, metadata: ChunkedConnectorMetadata) -> None:
        for spec in metadata.saves:
            if spec.request_id in self._failed:
                continue
            started = time.perf_counter()
            save = self._saves.get(spec.request_id)
            if save is None:
                keys = self._prompt_keys(spec.request_id, spec.token_ids, spec.cache_salt)
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
            self.store.put_layer(layer, dict(zip(keys, host.tensors)))
        finally:
            self.transfer.release(host)
        return time.perf_counter() - started

    def wait_for_save(self) -> None:
        saves, self._saves = self._saves, {}
        for rid in self._drop_saves_of_failed_loads():
            saves.pop(rid, None)
        deadline = time.monotonic() + self.load_timeout_s  # one bound for the whole step, not per layer
        for rid, save in saves.items():
            spec = save.spec
            try:
                for future in save.futures:
                    save.io_seconds += self.store.result(future, max(0.0, deadline - time.monotonic()))
                if len(save.futures) != self.num_layers:
                    raise NotFound(f"only {len(save.futures)} of {self.num_layers} layers were written")
                started = time.perf_counter()
                self.store.commit(save.keys)
                save.io_seconds += time.perf_counter() - started
            except Exception as exc:  # a save failure never fails the request
                self.metrics.on_save_failure(rid, self._failure_reason(exc))
                continue
            self.metrics.on_save(rid, spec.start, spec.end, len(spec.token_ids), spec.skip_leading_tokens,
                                 len(save.keys), save.num_bytes, save.io_seconds)

    def shutdown(self) -> None:
        self.store.close()
