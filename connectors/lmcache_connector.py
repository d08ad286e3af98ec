"""KV hand-off through the real LMCache engine (its chunking, keys and storage backends).

The shared store between nodes is an `lmcache_server` (`lm://host:port`); configuration comes
from an LMCache YAML file (`lmcache_config`) and `LMCACHE_*` variables over our defaults.
Bytes move through `PagedKVCPUConnector`. Two deliberate departures from LMCache defaults:

- chunk keys use a blake2b chain instead of Python's `hash()`: LMCache falls back to the
  builtin when vLLM is absent, and our keys must never depend on the interpreter;
- the partial last chunk is saved (`save_unfull_chunk: true`), as docs/architecture.md (Chunk alignment) requires.

LMCache's retrieve/store are whole-sequence calls, so a load runs in the background from
`start_load_kv` (a layer-wise one is waited for before layer 0); a save copies its tokens out of
paged memory after the last layer wrote its KV (the blocks may be reused right after the step)
and stores the copy in the background. One I/O thread serialises every LMCache call; a second
thread waits for saves to become visible, so no step ever waits for LMCache.
"""
from __future__ import annotations

import concurrent.futures
import multiprocessing
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import yaml

from pdserve.kvstore.registry import LMCACHE_EXTRA

try:  # an extra (pyproject.toml): a CPU install without it pulls none of LMCache's CUDA packages
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
except ModuleNotFoundError as exc:
    if not (exc.name or "").startswith("lmcache"):
        raise
    raise ModuleNotFoundError(f"the LMCache connector (lm:// stores, LMCache configs) needs LMCache, which is not "
                              f"installed: {LMCACHE_EXTRA}", name=exc.name) from None

from pdserve.common.hashing import digest, salt_tag, token_bytes
from pdserve.connectors.chunked import ChunkedConnector, ChunkedConnectorMetadata, InFlightLoad, LoadSpec, PendingSave, SaveSpec
from pdserve.connectors.lmcache_cpu import PagedKVCPUConnector
from pdserve import kernels
from pdserve.engine.config import KVRole
from pdserve.kvstore.layout import KVShard

if TYPE_CHECKING:
    from pdserve.engine.config import EngineConfig, KVTransferConfig
    from pdserve.engine.request import Request

_DEFAULTS: dict[str, Any] = {
    "local_cpu": False,  # the lmcache_server is the store; a node-local copy would hide cross-node misses
    "max_local_cpu_size": 1.0,  # GB of LMCache staging memory
    "save_unfull_chunk": True,
    "remote_serde": "naive",
}
_POLL_S = 0.002


def build_lmcache_config(kt: KVTransferConfig) -> LMCacheEngineConfig:
    """Our defaults, then the YAML file, then kv_store (the node flag), then LMCACHE_* variables."""
    values: dict[str, Any] = {"chunk_size": kt.chunk_size, **_DEFAULTS}
    if kt.lmcache_config:
        path = Path(kt.lmcache_config)
        if not path.is_file():
            raise ValueError(f"lmcache_config {str(path)!r} is not a file")
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"lmcache_config {str(path)!r} must hold a YAML mapping of LMCache options")
        values.update(loaded)
    if kt.kv_store:
        values["remote_url"] = kt.kv_store
    config = LMCacheEngineConfig.from_dict(values)
    config.update_config_from_env()
    return config


def chunk_hash(item: tuple[int, tuple[int, ...], tuple[Any, ...]]) -> bytes:
    """LMCache's per-chunk hash input (prefix hash, chunk tokens, extra keys) -> blake2b digest.

    LMCache keeps the first 8 bytes as the chunk's int hash, so keys are identical in every
    process regardless of PYTHONHASHSEED or the Python build."""
    prefix, tokens, extra = item
    return digest(b"pdserve-lmcache-chunk", int(prefix).to_bytes(8, "big"), token_bytes(list(tokens)),
                  repr(tuple(extra)).encode())


def refuse_parallel_layout(shard: KVShard | None) -> None:
    """LMCache's chunk keys carry the world size and the worker id, so its KV is only found by a node of the
    very layout that saved it, and this connector is one worker: refuse anything but the single-process
    layout at start-up (ValueError, one line), instead of a decode that silently never hits."""
    if shard is not None and shard.world > 1:
        raise ValueError(f"the LMCache connector serves one process per node (TP=1, PP=1), not {shard.world} "
                         "ranks: LMCache's keys carry the world size and worker id, so prefill and decode would "
                         "have to share one layout; use a file:// or redis:// store for TP/PP (any layout reads "
                         "any other there)")


def salt_configs(cache_salt: str | None, lora_fingerprint: str | None = None) -> dict[str, str] | None:
    """Cache salt and LoRA adapter as an LMCache key tag: different salts or adapters never share a chunk
    (LMCache hashes the tokens alone: vLLM #44250)."""
    tag = salt_tag(cache_salt, lora_fingerprint)
    return None if tag is None else {"lmcache.tag.salt": tag}


class LMCacheConnector(ChunkedConnector):
    def __init__(self, config: EngineConfig, runner: Any, shard: KVShard | None = None) -> None:
        kt = config.kv_transfer
        refuse_parallel_layout(shard or getattr(runner, "kv_shard", None))
        self.lmcache_config = build_lmcache_config(kt)
        chunk_size = self.lmcache_config.chunk_size
        if chunk_size % config.cache.block_size:
            raise ValueError(f"LMCache chunk_size ({chunk_size}) must be a multiple of block_size "
                             f"({config.cache.block_size})")
        super().__init__(KVRole(kt.kv_role or KVRole.BOTH), chunk_size, config.cache.block_size,
                         kt.load_timeout_s, kt.save_timeout_s)
        self.num_layers: int = runner.num_layers
        self.token_bytes = 2 * runner.num_layers * runner.num_kv_heads * runner.head_dim * \
            torch.empty((), dtype=runner.dtype).element_size()
        metadata = LMCacheMetadata(
            model_name=f"pdserve-{runner.fingerprint}", world_size=1, local_world_size=1, worker_id=0,
            local_worker_id=0, kv_dtype=runner.dtype,
            kv_shape=(runner.num_layers, 2, chunk_size, runner.num_kv_heads, runner.head_dim), chunk_size=chunk_size)
        self.instance_id = f"pdserve-{uuid.uuid4().hex[:12]}"
        start_method = multiprocessing.get_start_method(allow_none=True)
        self.engine = LMCacheEngineBuilder.get_or_create(
            self.instance_id, self.lmcache_config, metadata,
            PagedKVCPUConnector(runner.num_layers, runner.num_kv_heads, runner.head_dim), None, None)
        # LMCacheEngine forces the "spawn" start method process-wide (for a controller we do not run).
        multiprocessing.set_start_method(start_method, force=True)
        self.engine.post_init()
        self.engine.token_database.hash_func = chunk_hash
        self._remote_only = ["RemoteBackend"] if self.lmcache_config.remote_url else None
        self._io = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lmcache-io")
        self._save_waiter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lmcache-save")
        self.kv_caches: list[torch.Tensor] = []
        self._saves: list[tuple[SaveSpec, torch.Tensor]] = []  # this step's saves: spec, [L, 2, n, heads, dim] copy

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run one LMCache call on the I/O thread, bounded by load_timeout_s."""
        return self._io.submit(fn, *args, **kwargs).result(timeout=self.load_timeout_s)

    def _failure_reason(self, exc: BaseException) -> str:
        if isinstance(exc, concurrent.futures.TimeoutError):
            return f"timeout: LMCache did not answer within {self.load_timeout_s:g}s"
        if isinstance(exc, LookupError):
            return f"missing: {exc}"
        return f"error: {type(exc).__name__}: {exc}"

    # ---- scheduler side ----
    def start_lookup(self, request: Request) -> concurrent.futures.Future:
        return self._io.submit(self.engine.lookup, tokens=list(request.prompt_token_ids),
                               request_configs=salt_configs(request.cache_salt, request.lora_fingerprint))

    # ---- worker side ----
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self.kv_caches = list(kv_caches)

    def _start_loads(self, specs: list[LoadSpec]) -> list[InFlightLoad]:
        loads = []
        for spec in specs:
            load = InFlightLoad(spec)
            load.futures[0] = self._io.submit(self._retrieve, load)
            loads.append(load)
        return loads

    def _retrieve(self, load: InFlightLoad) -> int:
        """Read chunks [aligned_start, H) and write only tokens [N, N + need) (slot -1 elsewhere)."""
        plan = load.spec.plan
        mask = torch.ones(plan.hit, dtype=torch.bool)
        mask[:plan.aligned_start] = False
        slot_mapping = torch.full((plan.hit,), -1, dtype=torch.long)
        start, end = plan.write_range
        slot_mapping[start:end] = load.spec.slots
        configs = salt_configs(load.spec.cache_salt, load.spec.lora_fingerprint)
        got = int(self.engine.retrieve(load.spec.token_ids[:plan.hit], mask=mask, kvcaches=self.kv_caches,
                                       slot_mapping=slot_mapping, load_guard=load, req_id=load.spec.request_id,
                                       request_configs=configs).sum())
        if got < plan.retrieved:
            raise LookupError(f"partial: retrieved {got} of {plan.retrieved} tokens")
        load.finished = time.perf_counter()
        return got * self.token_bytes

    def wait_for_layer_load(self, layer_idx: int) -> None:
        """Layer-wise loads only: the whole-sequence retrieve must be done before layer 0."""
        if layer_idx != 0:
            return
        for load in self._loads:
            try:
                load.futures[0].result(timeout=max(0.0, load.deadline - time.monotonic()))
            except Exception as exc:  # timeout, unreachable server, missing chunk: recompute
                self._fail_load(load, exc)
                continue
            self._settle_load(load)

    def save_kv_layer(self, layer_idx: int, kv_cache: torch.Tensor, metadata: ChunkedConnectorMetadata) -> None:
        if layer_idx != self.num_layers - 1:
            return
        for spec in metadata.saves:
            if spec.request_id not in self._failed:
                # a copy (on the KV's device), so the put may outlive the step and the blocks be reused
                slots = spec.slots.to(self.kv_caches[0].device, non_blocking=True)
                self._saves.append((spec, kernels.gather_kv_layers(self.kv_caches, slots)))

    def wait_for_save(self) -> None:
        dropped = self._drop_saves_of_failed_loads()
        saves, self._saves = self._saves, []
        for spec, kv in saves:
            if spec.request_id not in dropped:
                pending = self._track_save(spec)
                pending.done = self._save_waiter.submit(self._store_and_confirm, spec, kv, pending)

    def _store_and_confirm(self, spec: SaveSpec, kv: torch.Tensor, pending: PendingSave) -> tuple[int, int, float]:
        """Store the copied tokens, then wait until the remote shows every chunk (the commit)."""
        started = time.perf_counter()
        self._call(self._store, spec, kv)
        self._wait_committed(spec, pending)
        num_chunks = -(-(spec.end - spec.start) // self.chunk_size)
        return num_chunks, (spec.end - spec.start) * self.token_bytes, time.perf_counter() - started

    def _store(self, spec: SaveSpec, kv: torch.Tensor) -> None:
        """The copy as a paged cache of one-token blocks: token i of [start, end) sits in slot i - start."""
        mask = torch.ones(spec.end, dtype=torch.bool)
        mask[:spec.start] = False
        slot_mapping = torch.full((spec.end,), -1, dtype=torch.long)
        slot_mapping[spec.start:spec.end] = torch.arange(spec.end - spec.start)
        self.engine.store(spec.token_ids[:spec.end], mask=mask, kvcaches=[layer.unsqueeze(2) for layer in kv],
                          slot_mapping=slot_mapping, req_id=spec.request_id,
                          request_configs=salt_configs(spec.cache_salt, spec.lora_fingerprint))

    def _wait_committed(self, spec: SaveSpec, pending: PendingSave) -> None:
        """LMCache puts to the remote asynchronously: the save is done once a lookup sees every chunk."""
        configs = salt_configs(spec.cache_salt, spec.lora_fingerprint)
        target = spec.end if self.lmcache_config.save_unfull_chunk else spec.end // self.chunk_size * self.chunk_size
        while True:
            found = self._call(self.engine.lookup, tokens=spec.token_ids[:spec.end], request_configs=configs,
                               search_range=self._remote_only)
            if found >= target:
                return
            if pending.abandoned or time.monotonic() > pending.deadline:
                raise TimeoutError(f"only {found} of {spec.end} tokens visible after {self.save_timeout_s:g}s")
            time.sleep(_POLL_S)

    def shutdown(self) -> None:
        self._save_waiter.shutdown(wait=True)
        self._io.shutdown(wait=True)
        LMCacheEngineBuilder.destroy(self.instance_id)
