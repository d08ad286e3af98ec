"""The engine's one device, and where every tensor of the engine is placed.

`EngineConfig.device.device` (`--device auto|cpu|cuda|cuda:N`) is the only place a device is
named; `resolve_device` turns it into a `torch.device` once at start-up and `Platform` carries
it from there. Placement, all through this module:

| tensor                                        | where                      | made by                          |
|-----------------------------------------------|----------------------------|----------------------------------|
| weights (read from safetensors onto it)        | device                     | `Platform.device` -> loader      |
| RoPE cos/sin tables                            | device                     | models.llama.RotaryEmbedding     |
| paged KV caches, one per layer                 | device                     | `Platform.allocate_kv_caches`    |
| step metadata: input ids, positions, slot      | host (pinned on CUDA), then| `Platform.host_device_buffer`    |
|   mapping, block tables, query starts, seq lens|   device, non_blocking     |   (engine.input_batch)           |
| logits, sampling, generators                   | device                     | engine.sampler                   |
| sampled ids (+ logprobs when asked)            | host: the step's one sync  | engine.sampler                   |
| connector staging (store reads and saves)      | host, pinned on CUDA       | `Platform.pinned_empty`          |

On CPU the stream and event calls below are synchronous no-ops and "pinned" host buffers are
ordinary memory, so the same engine and connector code runs (and is tested) on both devices.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.engine.config import DEVICE_RE
from pdserve.kernels.host_memory import huge_empty


def resolve_device(spec: str) -> torch.device:
    """'auto' -> the current CUDA device when one is available, else the CPU; 'cuda:N' checked."""
    if not DEVICE_RE.fullmatch(spec):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {spec!r}")
    if spec == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"device {spec!r} was asked for, but this torch build sees no CUDA device "
                         f"(torch {torch.__version__}); use --device cpu")
    device = torch.device(spec)
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise ValueError(f"device {spec!r} does not exist: {torch.cuda.device_count()} CUDA device(s) visible")
    return torch.device("cuda", index)


class NullEvent:
    """A CUDA event's interface on the CPU, where every operation has already happened."""

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass


@dataclass(frozen=True)
class Platform:
    """Device-specific calls behind one small surface; on CPU they degrade to synchronous no-ops."""

    device: torch.device

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def describe(self) -> str:
        if not self.is_cuda:
            return "cpu"
        props = torch.cuda.get_device_properties(self.device)
        return f"{self.device} ({props.name}, {props.total_memory / 2**30:.1f} GiB)"

    # ---- memory ----
    def pinned_empty(self, shape: tuple[int, ...] | int, dtype: torch.dtype) -> torch.Tensor:
        """Host memory the device can copy from/to asynchronously (page-locked on CUDA)."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.is_cuda)

    def host_device_buffer(self, size: int, dtype: torch.dtype) -> HostDeviceBuffer:
        return HostDeviceBuffer(self, size, dtype)

    def allocate_kv_caches(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                           head_dim: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """One [2, num_blocks, block_size, kv_heads, head_dim] tensor per layer (docs/architecture.md, §7).
        Zeroed, not empty: padded attention reads of unused slots must be finite. On the CPU in huge
        pages where the OS allows (kernels/host_memory.py): decode attention streams them."""
        shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
        if self.is_cuda:
            return [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        return [huge_empty(shape, dtype).zero_() for _ in range(num_layers)]

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of the device; only meaningful on CUDA."""
        if not self.is_cuda:
            raise ValueError("device memory figures exist only for CUDA devices")
        return torch.cuda.mem_get_info(self.device)

    # ---- streams and events ----
    def new_stream(self) -> Any:
        """A side stream (None on CPU: work runs where it is issued, in order)."""
        return torch.cuda.Stream(self.device) if self.is_cuda else None

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device) if self.is_cuda else None

    def new_event(self) -> Any:
        return torch.cuda.Event() if self.is_cuda else NullEvent()

    @contextlib.contextmanager
    def stream(self, stream: Any) -> Iterator[None]:
        """Issue the block's device work on `stream` (no-op on CPU or when stream is None)."""
        if stream is None:
            yield
            return
        with torch.cuda.stream(stream):
            yield

    def wait_event(self, event: Any, stream: Any = None) -> None:
        """Make `stream` (default: the current one) wait for `event` without blocking the host."""
        if self.is_cuda and not isinstance(event, NullEvent):
            (stream or torch.cuda.current_stream(self.device)).wait_event(event)

    def wait_stream(self, waiter: Any, other: Any = None) -> None:
        """Make stream `waiter` wait for all work issued so far on `other` (default: the current stream)."""
        if self.is_cuda and waiter is not None:
            waiter.wait_stream(other or torch.cuda.current_stream(self.device))

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """Tell the caching allocator `tensor` is in use on `stream` until the work issued there ends."""
        if self.is_cuda and stream is not None and tensor.is_cuda:
            tensor.record_stream(stream)

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)


class HostDeviceBuffer:
    """A persistent host buffer and its device twin for one kind of per-step metadata.

    The host fills `host[:n]`; `to_device(n)` starts a non-blocking copy and returns the device
    view. On CPU the two are one tensor and nothing is copied.
    """

    def __init__(self, platform: Platform, size: int, dtype: torch.dtype) -> None:
        self.platform = platform
        self.host = platform.pinned_empty(size, dtype)
        self.device = torch.empty(size, dtype=dtype, device=platform.device) if platform.is_cuda else self.host

    @property
    def size(self) -> int:
        return self.host.numel()

    def to_device(self, n: int) -> torch.Tensor:
        if self.device is not self.host:
            self.device[:n].copy_(self.host[:n], non_blocking=True)
        return self.device[:n]
