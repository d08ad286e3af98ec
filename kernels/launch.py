"""One guard around every Triton launch: the right GPU, and one interpreter at a time.

- A Triton launch goes to the calling thread's current CUDA device and stream, not to its
  tensors' device. The engine steps in its own thread and the connectors copy from I/O
  threads, whose current device is cuda:0 whatever the engine's is, so each launch makes its
  tensors' device current (with `--device cuda:1` a launch would otherwise land on cuda:0).
- Triton's interpreter is not thread-safe (it patches triton.language globally while it runs a
  kernel), so in the CPU tests interpreted launches from the forward pass and from a
  connector's I/O thread take turns. Compiled launches take no lock.
"""
from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

import torch

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # read when triton is, at first import
_lock = threading.RLock()


@contextlib.contextmanager
def launch_guard(device: torch.device) -> Iterator[None]:
    if device.type == "cuda":
        with torch.cuda.device(device):
            yield
    elif _INTERPRETED:
        with _lock:
            yield
    else:
        yield
