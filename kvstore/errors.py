"""Typed store errors: callers (the connectors) turn every one of them into "recompute", never a crash."""
from __future__ import annotations


class StoreError(Exception):
    """Base class of every kvstore failure."""


class StoreUnavailable(StoreError):
    """The backend cannot be reached (redis down, directory missing or unwritable)."""


class StoreTimeout(StoreError):
    """The backend did not answer within the configured timeout."""


class CorruptObject(StoreError):
    """An object failed validation: bad magic/version/length/checksum or the wrong model, dtype or shape."""


class NotFound(StoreError):
    """A requested object or chunk is absent (never written, evicted, expired or deleted)."""
