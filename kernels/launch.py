"""One guard around every Triton launch: Triton's interpreter is not thread-safe.

The interpreter patches triton.language globally while it runs a kernel, so two threads
interpreting at once (the engine's forward pass and a connector's I/O thread, in the CPU
tests) break each other. Compiled launches on a GPU are thread-safe and take no lock.
"""
from __future__ import annotations

import contextlib
import os
import threading

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # read when triton is, at first import
_lock = threading.RLock()


def launch_guard() -> contextlib.AbstractContextManager:
    return _lock if _INTERPRETED else contextlib.nullcontext()
