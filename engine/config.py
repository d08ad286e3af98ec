"""Engine configuration as frozen, validated dataclasses (one per concern, as in vLLM)."""
from __future__ import annotations

import dataclasses
import enum
import re
from dataclasses import dataclass, field
from typing import Any

from pdserve.common.units import parse_bytes

DTYPES = ("auto", "float32", "float16", "bfloat16")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
DEVICE_RE = re.compile(r"auto|cpu|cuda(:\d+)?")
# How a decode request's external KV is loaded (README "KV load modes" has the measurement):
#   async     - in the background while the request waits (WAITING_FOR_REMOTE_KVS); others keep stepping
#   layerwise - inside the forward pass, layer i's read overlapping layers < i's compute (a slow store
#               stalls the whole step, up to load_timeout_s)
#   auto      - layerwise when the request would be alone in its step, async otherwise
KV_LOAD_MODES = ("auto", "async", "layerwise")


@dataclass(frozen=True)
class ModelConfig:
    model: str
    dtype: str = "auto"  # auto: the checkpoint's dtype
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must be a path to a Hugging Face model directory")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")


@dataclass(frozen=True)
class DeviceConfig:
    """The engine's one device (engine/device.py places every tensor on it) and attention backend."""

    device: str = "auto"  # auto (CUDA when available) | cpu | cuda | cuda:N
    attention_backend: str = "auto"  # auto: the compiled CPU kernel on CPU, Triton on CUDA
    # torch (OpenMP) threads of the engine, split over its ranks; None: the CPUs the process may use (its cgroup
    # CPU quota and affinity mask), or OMP_NUM_THREADS per rank (common/cpu_budget.py)
    threads: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.device, str) or not DEVICE_RE.fullmatch(self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if self.threads is not None and (not isinstance(self.threads, int) or isinstance(self.threads, bool)
                                         or self.threads < 1):
            raise ValueError(f"threads must be an integer >= 1, got {self.threads!r}")


DEFAULT_KV_CACHE_MEMORY = 1 << 30  # on CPU, when neither KV sizing option is given
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # on CUDA, when neither is given


@dataclass(frozen=True)
class CacheConfig:
    """KV cache sizing: `kv_cache_memory` bytes, or (CUDA) `gpu_memory_utilization` of the device's
    memory minus what the weights and a profiled max-batch forward use. At most one of the two."""

    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes for all layers' paged KV; strings like "2GiB" accepted
    gpu_memory_utilization: float | None = None  # fraction of device memory for this engine
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.kv_cache_memory is not None:
            object.__setattr__(self, "kv_cache_memory", parse_bytes(self.kv_cache_memory))
            if self.kv_cache_memory <= 0:
                raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.gpu_memory_utilization is not None:
            if not 0.0 < self.gpu_memory_utilization <= 1.0:
                raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
            if self.kv_cache_memory is not None:
                raise ValueError("give kv_cache_memory or gpu_memory_utilization, not both")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0  # 0: a prefill may take the whole budget

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")


class KVRole(str, enum.Enum):
    """What a node does with the shared store: vLLM's `kv_role` values.

    (vLLM's own KVConnectorRole means scheduler-side vs worker-side; here one connector object
    plays both sides, so that enum has no counterpart.)
    """

    PRODUCER = "kv_producer"  # prefill node: saves KV
    CONSUMER = "kv_consumer"  # decode node: loads KV
    BOTH = "kv_both"

    @classmethod
    def parse(cls, value: str) -> KVRole:
        """vLLM's spelling, or the short one pdserve command lines used first (producer|consumer|both)."""
        try:
            return cls(value if str(value).startswith("kv_") else f"kv_{value}")
        except ValueError:
            raise ValueError(f"kv_role must be kv_producer, kv_consumer or kv_both (or producer, consumer, both), "
                             f"got {value!r}") from None

    @property
    def saves(self) -> bool:
        return self in (KVRole.PRODUCER, KVRole.BOTH)

    @property
    def loads(self) -> bool:
        return self in (KVRole.CONSUMER, KVRole.BOTH)


@dataclass(frozen=True)
class KVTransferConfig:
    """Where KV goes between nodes; kv_store None means no connector (monolithic serving)."""

    kv_store: str | None = None  # file:///dir, redis://host:port/db, lm://host:port
    kv_role: str | None = None  # kv_producer | kv_consumer | kv_both (vLLM's words; producer etc. accepted)
    chunk_size: int = 256
    lmcache_config: str | None = None
    load_timeout_s: float = 10.0  # a lookup or a load unanswered this long -> recompute
    kv_load_mode: str = "async"
    # A finished producer request's output (the prefill reply) waits at most this long for its
    # chunks' commit; a slower save goes on in the background and never holds a step.
    save_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.kv_role is not None:
            object.__setattr__(self, "kv_role", KVRole.parse(self.kv_role).value)
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.load_timeout_s <= 0:
            raise ValueError(f"load_timeout_s must be positive, got {self.load_timeout_s}")
        if self.save_timeout_s <= 0:
            raise ValueError(f"save_timeout_s must be positive, got {self.save_timeout_s}")
        if self.kv_load_mode not in KV_LOAD_MODES:
            raise ValueError(f"kv_load_mode must be one of {', '.join(KV_LOAD_MODES)}, got {self.kv_load_mode!r}")

    @property
    def enabled(self) -> bool:
        return self.kv_store is not None or self.lmcache_config is not None


@dataclass(frozen=True)
class ParallelConfig:
    """vLLM's tensor_parallel_size / pipeline_parallel_size: one process per rank (engine/parallel/).

    `distributed_timeout_s` bounds every collective of a step and the ranks' join at start-up, so a rank
    that hangs or never arrives fails the engine instead of blocking it (gloo cannot be interrupted)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not self.distributed_timeout_s > 0:
            raise ValueError(f"distributed_timeout_s must be positive, got {self.distributed_timeout_s}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


LORA_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (docs/lora.md), vLLM's bounds: `max_loras` adapters in one batch (resident in the
    batch's slots), ranks up to `max_lora_rank`, `max_cpu_loras` adapters kept loaded (LRU; None: max_loras).
    `lora_dtype`: the dtype adapter weights are held in, as vLLM's: `auto` is the model's (a bf16 model's adapters
    rounded to bf16, half the bytes a decode step reads), `float32` keeps them as PEFT does."""

    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str = "auto"

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            value = getattr(self, name)
            if value is None and name == "max_cpu_loras":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"lora_dtype must be one of {', '.join(LORA_DTYPES)}, got {self.lora_dtype!r}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")

    @property
    def cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        if self.lora.enable_lora and self.parallel.world_size > 1:
            # Each rank would need its shard of every adapter's B (and A for o/down): not built yet.
            raise ValueError("LoRA adapters are not supported with tensor or pipeline parallelism yet "
                             "(-tp/-pp must be 1 with enable_lora)")
        if self.kv_transfer.enabled and self.kv_transfer.chunk_size % self.cache.block_size:
            raise ValueError(f"chunk_size ({self.kv_transfer.chunk_size}) must be a multiple of "
                             f"block_size ({self.cache.block_size})")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        """Build from flat keyword options (LLM(...) and the CLIs); unknown names are an error."""
        parts: dict[str, dict[str, Any]] = {"model": {}, "cache": {}, "scheduler": {}, "kv_transfer": {},
                                            "device": {}, "parallel": {}, "lora": {}}
        classes = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
                   "kv_transfer": KVTransferConfig, "device": DeviceConfig, "parallel": ParallelConfig,
                   "lora": LoRAConfig}
        for key, value in kwargs.items():
            for part, klass in classes.items():
                if key in {f.name for f in dataclasses.fields(klass)}:
                    parts[part][key] = value
                    break
            else:
                raise TypeError(f"unknown engine option {key!r}")
        return cls(model=ModelConfig(model=str(model), **parts["model"]), cache=CacheConfig(**parts["cache"]),
                   scheduler=SchedulerConfig(**parts["scheduler"]),
                   kv_transfer=KVTransferConfig(**parts["kv_transfer"]), device=DeviceConfig(**parts["device"]),
                   parallel=ParallelConfig(**parts["parallel"]), lora=LoRAConfig(**parts["lora"]))
