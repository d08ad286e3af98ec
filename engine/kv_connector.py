"""The KV connector API, shaped like vLLM's V1 KVConnectorBase.

The interface belongs to its caller, the engine; the implementations (store, LMCache) live in
`connectors/` and reach the engine through a ConnectorFactory that the serving layer passes to
LLMEngine, so the engine never imports them (docs/architecture.md).

One connector object lives in each engine and serves both halves (scheduler and worker
share a process here). The engine calls it at these points:

scheduler side
  - `get_num_new_matched_tokens(request, num_computed_tokens)` after a waiting request's
    local prefix-cache lookup: how many more tokens the store can provide, or None while the
    answer is not known yet (the lookup runs in the background; the scheduler skips the
    request this step and asks again next step).
  - `update_state_after_alloc(request, block_ids, num_external_tokens)` after blocks for
    local hits + external tokens + new tokens were allocated. A request whose status is then
    WAITING_FOR_REMOTE_KVS loads in the background across steps (it is not scheduled until
    `get_finished` reports it); any other loads inside the next forward pass, layer by layer.
  - `build_connector_meta(scheduler_output)` when the step's output is built.
  - `request_finished(request, block_ids)` when a request finishes or is aborted.
worker side (model runner)
  - `register_kv_caches(kv_caches)` once, after the paged KV tensors exist.
  - `start_load_kv(metadata)` before the forward pass; `wait_for_layer_load(i)` before
    layer i's attention; `save_kv_layer(i, kv_cache, metadata)` after layer i wrote its
    KV; `wait_for_save()` at the end of the step hands the step's saves to the background
    (it never waits for the store); `get_finished(finished_req_ids)` and `get_failed_loads()`
    after every step, also steps that computed nothing (background I/O still moves).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from pdserve.engine.config import KVRole

if TYPE_CHECKING:
    import torch

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.request import Request
    from pdserve.engine.scheduler_output import SchedulerOutput


# Builds an engine's connector from its config once the model runner (shapes, KV tensors) exists.
ConnectorFactory = Callable[["EngineConfig", Any], "KVConnectorBase | None"]


@dataclass
class KVConnectorMetadata:
    """Per-step instructions from the scheduler half to the worker half (subclassed)."""


class KVConnectorBase(ABC):
    def __init__(self, role: KVRole) -> None:
        self.role = role

    # ---- scheduler side ----
    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """(tokens beyond `num_computed_tokens` that can be loaded, whether the load may run in the
        background while the request waits). None: the lookup is still in flight, ask again later."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """Remember where the external tokens of `request` must be written."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Turn this step's loads and saves into metadata for the worker side."""

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """(delay, params for the caller). delay=True: a save from the request's blocks is still in flight;
        the scheduler keeps the blocks (and holds the request's final output) until `get_finished`
        reports the request in finished_sending."""
        return False, None

    # ---- worker side ----
    @abstractmethod
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Receive the paged KV tensors, one [2, num_blocks, block_size, kv_heads, head_dim] per layer."""

    @abstractmethod
    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Begin loading this step's external KV in the background."""

    @abstractmethod
    def wait_for_layer_load(self, layer_idx: int) -> None:
        """Block until layer `layer_idx`'s KV for this step is in paged memory (or failed)."""

    @abstractmethod
    def save_kv_layer(self, layer_idx: int, kv_cache: torch.Tensor, metadata: KVConnectorMetadata) -> None:
        """Start saving layer `layer_idx`'s KV of this step's completed chunks (background)."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """End of the step's saves: the store I/O goes on in the background; never blocks on the store."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(finished requests whose saves ended: free their blocks, release their output;
        requests whose background load ended, successfully or not)."""
        return None, None

    def get_failed_loads(self) -> set[str]:
        """Request ids whose load failed since the last call (in this step's forward pass, or a
        background load reported by `get_finished`); the engine recomputes their tokens."""
        return set()

    def shutdown(self) -> None:
        """Release threads and connections."""
