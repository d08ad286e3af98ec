"""LoRAManager: which adapters are loaded, which sit in the batch's slots, and each step's row groups.

Two bounds, vLLM's:
- `max_cpu_loras` adapters stay loaded (read from disk once, LRU beyond that). An adapter still used
  by a request in flight stays with that request when the cache drops it.
- `max_loras` adapters take part in one step (the scheduler admits no request whose adapter would
  make one more); their weights are resident on the engine's device in the batch slots, LRU too (on
  CPU the slot holds the loaded tensors themselves).
Reading a directory happens in `load` (the engine's add_request, or a server's executor thread via
`read`, which touches no shared state).
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from pdserve.engine.config import LoRAConfig
from pdserve.engine.lora.adapter import LoRAAdapter, LoRAError, LoRAModule, TargetLayout
from pdserve.engine.lora.layers import Group, LoRALinear, LoRAStep
from pdserve.engine.lora.peft_format import read_adapter, stamp
from pdserve.engine.lora.request import LoRARequest
from pdserve.engine.lora.stacked import LoRAStack, RowSlots

if TYPE_CHECKING:
    from pdserve.engine.input_batch import StepInputs

logger = logging.getLogger(__name__)

# Steps of at most this many token rows take the batched path (stacked.py); larger ones (prefill) the
# groups' path, which multiplies each row by its own adapter only (measured: benchmarks/lora_throughput.py).
# Where the batched path is the compiled kernel (CPU) every step takes it: the kernel too multiplies each row
# by its own adapter only, and does it in a third of the groups' path's CPU time on 2,048 prefill rows of
# SmolLM2-135M with 4 adapters of rank 16 (its gathers, fp32 copies and small matmuls per adapter and part).
BATCHED_MAX_ROWS = 64

_TARGETS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))


class LoRAManager:
    def __init__(self, config: LoRAConfig, model: Any, hidden_size: int, device: torch.device,
                 model_dtype: torch.dtype = torch.float32) -> None:
        self.config = config
        self.device = device
        # what adapter weights are rounded to (`--lora-dtype`; auto: the model's, as vLLM holds them)
        self.dtype = model_dtype if config.lora_dtype == "auto" else getattr(torch, config.lora_dtype)
        self.layout = TargetLayout.of(model, hidden_size)
        self.step = LoRAStep()
        self._layers: list[LoRALinear] = []
        for i in self.layout.layers:  # every linear layer an adapter may name gets the LoRA path
            for block, name in _TARGETS:
                parent = getattr(model.layers[i], block)
                layer = LoRALinear(getattr(parent, name), i, name, self.step)
                in_features, widths = self.layout.parts[name]
                layer.stack = LoRAStack(config.max_loras, config.max_lora_rank, in_features, widths, device,
                                        self.dtype)
                setattr(parent, name, layer)
                self._layers.append(layer)
        self._compiled = bool(self._layers) and all(layer.stack is not None and layer.stack.kernel is not None
                                                    for layer in self._layers)
        self._loaded: OrderedDict[int, LoRAAdapter] = OrderedDict()  # lora_int_id -> adapter, LRU first
        # adapter -> (its slot in the layers' stacks, its modules on the device), least recently used first
        self._slots: OrderedDict[LoRAAdapter, tuple[int, dict[tuple[int, str], LoRAModule]]] = OrderedDict()

    # ---- adapters in memory ----
    def read(self, request: LoRARequest) -> LoRAAdapter:
        """Read and check an adapter directory (any thread: nothing shared changes); LoRAError if unusable."""
        return read_adapter(request, self.layout, self.config.max_lora_rank, self.dtype)

    def load(self, request: LoRARequest) -> LoRAAdapter:
        """The loaded adapter of `request`: the cached one when its id, name, path and files are unchanged."""
        cached = self._loaded.get(request.lora_int_id)
        if (cached is not None and cached.path == request.lora_path and cached.name == request.lora_name
                and cached.stamp == stamp(request.lora_path)):
            self._loaded.move_to_end(request.lora_int_id)
            return cached
        return self.add(self.read(request))

    def add(self, adapter: LoRAAdapter) -> LoRAAdapter:
        """Keep `adapter` loaded under its id (replacing what had the id), dropping the least recently used
        beyond max_cpu_loras."""
        self._loaded.pop(adapter.int_id, None)
        self._loaded[adapter.int_id] = adapter
        while len(self._loaded) > self.config.cpu_loras:
            _, dropped = self._loaded.popitem(last=False)
            logger.info("LoRA adapter %s unloaded (least recently used beyond max_cpu_loras=%d)", dropped.label,
                        self.config.cpu_loras)
        logger.info("LoRA adapter %s loaded: id %d, rank %d, scaling %g, modules %s, %d bytes, from %s",
                    adapter.label, adapter.int_id, adapter.rank, adapter.scaling, ",".join(adapter.target_modules),
                    adapter.num_bytes, adapter.path)
        return adapter

    def remove(self, int_id: int) -> bool:
        """Forget an adapter (requests in flight under it finish with their copy); False if not loaded."""
        adapter = self._loaded.pop(int_id, None)
        if adapter is not None:
            logger.info("LoRA adapter %s unloaded (id %d)", adapter.label, int_id)
        return adapter is not None

    def list_ids(self) -> list[int]:
        return list(self._loaded)

    def loaded(self) -> list[LoRAAdapter]:
        """The adapters kept loaded, least recently used first."""
        return list(self._loaded.values())

    # ---- one step ----
    def prepare(self, inputs: StepInputs) -> None:
        """Set the step's LoRA work (the adapters' slots filled first): each row's slot and scaling for a step of
        at most BATCHED_MAX_ROWS rows or any step on the compiled kernel (the batched path), else the rows grouped
        by adapter; the base model's rows get none."""
        step = self.step
        qsl = inputs.attn_metadata.query_start_loc_cpu
        step.num_tokens = qsl[-1] if qsl else 0
        by_adapter: dict[LoRAAdapter, tuple[list[int], list[int]]] = {}
        for b, request in enumerate(inputs.requests):
            if request.lora is not None:
                by_adapter.setdefault(request.lora, ([], []))[0].extend(range(qsl[b], qsl[b + 1]))
        for k, b in enumerate(inputs.sample_rows):
            adapter = inputs.requests[b].lora
            if adapter is not None:
                by_adapter[adapter][1].append(k)
        step.rows, step.sampled, step.row_slots, step.sampled_slots = [], [], None, None
        if len(by_adapter) > self.config.max_loras:  # the scheduler's bound: never more in one step
            raise LoRAError(f"{len(by_adapter)} adapters in one step, above max_loras={self.config.max_loras}")
        slots = {adapter: self._slot(adapter, by_adapter) for adapter in by_adapter}
        if not slots:
            return
        if step.num_tokens <= BATCHED_MAX_ROWS or self._compiled:
            step.row_slots = self._row_slots(slots, {a: rows for a, (rows, _) in by_adapter.items()},
                                             step.num_tokens)
            step.sampled_slots = self._row_slots(slots, {a: s for a, (_, s) in by_adapter.items() if s},
                                                 len(inputs.sample_rows))
            return
        for adapter, (rows, sampled) in by_adapter.items():
            modules = slots[adapter][1]
            step.rows.append(self._group(modules, adapter.scaling, rows, step.num_tokens))
            if sampled:
                step.sampled.append(self._group(modules, adapter.scaling, sampled, len(inputs.sample_rows)))

    def _row_slots(self, slots: dict[LoRAAdapter, tuple[int, Any]], rows: dict[LoRAAdapter, list[int]],
                   num_rows: int) -> RowSlots | None:
        """Each of num_rows rows' slot (-1: the base model) and scaling (None: no row under an adapter)."""
        if not rows:
            return None
        row_slot, scaling = [-1] * num_rows, [0.0] * num_rows
        for adapter, indices in rows.items():
            slot = slots[adapter][0]
            for i in indices:
                row_slot[i], scaling[i] = slot, adapter.scaling
        return RowSlots(torch.tensor(row_slot, dtype=torch.int32), torch.tensor(scaling, dtype=torch.float32),
                        1 + max(slots[a][0] for a in rows), self.device)

    def _group(self, modules: dict[tuple[int, str], LoRAModule], scaling: float, rows: list[int],
               num_rows: int) -> Group:
        index = None if len(rows) == num_rows else torch.tensor(rows, dtype=torch.long, device=self.device)
        return modules, scaling, index

    def _slot(self, adapter: LoRAAdapter, in_step: dict[LoRAAdapter, Any]
              ) -> tuple[int, dict[tuple[int, str], LoRAModule]]:
        """The adapter's slot and weights on the device, in one of max_loras slots (LRU among adapters not in
        this step); a new occupant is written into every layer's stack, the only time the stacks change."""
        held = self._slots.get(adapter)
        if held is not None:
            self._slots.move_to_end(adapter)
            return held
        for old in [a for a in self._slots if a not in in_step][:max(0, len(self._slots) + 1 - self.config.max_loras)]:
            del self._slots[old]
        free = min(set(range(self.config.max_loras)) - {slot for slot, _ in self._slots.values()})
        on_device = adapter.modules if self.device.type == "cpu" else {
            key: module.to(self.device) for key, module in adapter.modules.items()}
        for layer in self._layers:
            assert layer.stack is not None
            layer.stack.write(free, on_device.get(layer.key))
        self._slots[adapter] = (free, on_device)
        return self._slots[adapter]


def resolve_lora(manager: LoRAManager | None, request: LoRARequest | None) -> LoRAAdapter | None:
    """The adapter a new request runs under (None: the base model); ValueError when it cannot be served."""
    if request is None:
        return None
    if not isinstance(request, LoRARequest):
        raise TypeError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
    if manager is None:
        raise ValueError("LoRA adapters are not enabled: start the engine with enable_lora=True (--enable-lora)")
    return manager.load(request)
