"""How a store's backend calls are made: guarded (only typed store errors escape) and counted.

Every member of a store (its layer reads, coded reads, administration) calls the backend through the
store's one StoreCalls, so the counters `stats()` returns cover them all and every backend failure
reaches the caller as a kvstore.errors type, which means "recompute" to a connector.
"""
from __future__ import annotations

import threading
from typing import Callable, ParamSpec, TypeVar

from pdserve.kvstore.errors import StoreError
from pdserve.kvstore.records import StoreStats

P = ParamSpec("P")
T = TypeVar("T")


class StoreCalls:
    """A store's counters (StoreStats, under a lock) and its backend's error translation: `io_errors` are
    the backend's own exceptions, `translate` maps one to a typed store error."""

    def __init__(self, io_errors: tuple[type[Exception], ...], translate: Callable[[Exception], StoreError]) -> None:
        self._io_errors = io_errors
        self._translate = translate
        self._stats = StoreStats()
        self._lock = threading.Lock()

    def guard(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Call a backend hook; count failures and make sure only StoreError subclasses escape."""
        try:
            return fn(*args, **kwargs)
        except StoreError:
            self.count(errors=1)
            raise
        except self._io_errors as exc:
            self.count(errors=1)
            raise self._translate(exc) from exc

    def count(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + delta)

    def stats(self) -> StoreStats:
        """A copy of the counters."""
        with self._lock:
            return StoreStats(**vars(self._stats))
