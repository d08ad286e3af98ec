"""The write gate of a load: how a store read may land straight in memory its caller can take back.

A decode node's load reads stored objects straight into paged KV blocks (no staging copy). Reads
run on the store's I/O threads and cannot be cancelled: a read stuck on a hung NFS mount or a
frozen redis may return minutes after its load was abandoned, when the blocks were recomputed or
belong to another request. So the bytes of a read reach such memory only *inside* the gate:

- a writer enters (`enter()`/`writing()`), copies, and leaves; every copy made inside is bounded, it never
  waits for the medium (a page-cache read with RWF_NOWAIT, a non-blocking recv of bytes already
  received, a memcpy from scratch memory). Waiting for the medium happens outside, into memory
  the I/O thread owns;
- `close()` (the load failed or was cancelled) waits for the writers inside, and from then on
  nobody enters: `enter()` raises LoadAbandoned. After close() returns, nothing this load
  started writes into its destination again, however late its reads return.

A compiled writer (kvstore/csrc/kv_recv.c, redis loads) enters and leaves without the GIL: it
shares two words with the gate (`native()`: [closed, inside], updated with atomics), and close()
shuts those too and waits until no compiled writer is inside either.

`NO_GATE` is for destinations the reader owns (a staging buffer): entering always succeeds.
docs/architecture.md, Invariants, states the rule the connector relies on.
"""
from __future__ import annotations

import contextlib
import ctypes
import threading
import time
from typing import Callable, Iterator

from pdserve.kvstore.errors import StoreError


class LoadAbandoned(StoreError):
    """The load this read belonged to was abandoned: its destination is no longer ours to write."""


class WriteGate:
    """Writers into a load's destination enter and leave; close() waits for them and shuts the gate."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._inside = 0
        self._closed = False
        self._words: ctypes.Array | None = None  # [closed, inside] of compiled writers (native())
        self._close_words: Callable[[int], int] | None = None

    @property
    def closed(self) -> bool:
        return self._closed

    def enter(self) -> None:
        """Start one bounded copy into the destination; LoadAbandoned once the gate is closed."""
        with self._cond:
            if self._closed:
                raise LoadAbandoned("the load was abandoned; its destination is no longer written")
            self._inside += 1

    def leave(self) -> None:
        with self._cond:
            self._inside -= 1
            if self._closed and not self._inside:  # close() is waiting for the last one out
                self._cond.notify_all()

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """enter() ... leave() around a block."""
        self.enter()
        try:
            yield
        finally:
            self.leave()

    def native(self, close_words: Callable[[int], int]) -> int:
        """The address of the gate's [closed, inside] words for a compiled writer, which enters with an
        atomic inside += 1 followed by a check that closed is still 0, and leaves with inside -= 1.
        `close_words(address)` sets closed atomically and returns inside (kvstore/native_reader.py's
        gate_close). LoadAbandoned once the gate is closed."""
        with self._cond:
            if self._closed:
                raise LoadAbandoned("the load was abandoned; its destination is no longer written")
            if self._words is None:
                self._words = (ctypes.c_int64 * 2)()
                self._close_words = close_words
            return ctypes.addressof(self._words)

    def close(self) -> None:
        """No writer enters from now on; returns once the writers inside have left (bounded copies)."""
        with self._cond:
            self._closed = True
            while self._inside:
                self._cond.wait()
            words, close_words = self._words, self._close_words
        if words is not None and close_words is not None:
            while close_words(ctypes.addressof(words)):  # a compiled writer inside: one non-blocking recv
                time.sleep(50e-6)


class _NoGate(WriteGate):
    """For destinations the reader owns: never closed, nothing to count."""

    def enter(self) -> None:
        pass

    def leave(self) -> None:
        pass

    def native(self, close_words: Callable[[int], int]) -> int:
        return 0  # compiled writers treat no words as a gate that is always open

    def close(self) -> None:
        raise ValueError("NO_GATE guards memory its reader owns; it cannot be closed")


NO_GATE: WriteGate = _NoGate()
