"""pdserve kvstore: chunked per-layer KV objects in a shared store (see kvstore.base for the API).

open_store(url, **options) picks the backend from the URL scheme; kvstore/registry.py is the table of
schemes, their store classes and their URL query options (docs/configuration.md, "KV store URLs"):
    file:///path?max_bytes=64GiB&fsync=0          FileSystemStore (local disk or NFS)
    redis://host:port/db?ttl=3600&prefix=pdkv:    RedisStore (rediss:// for TLS)
    redis+cluster://host:port[,host:port...]/?ttl=3600&prefix=pdkv:
                                                  RedisClusterStore (rediss+cluster:// for TLS)
Common options (URL query or keyword; keywords win): timeout (seconds), io_threads, codec (what writes
encode KV with: raw, the default; lossless; int8; fp8 — kvstore/payload_codecs.py; reads take any),
heads_per_object (an integer >= 0: writes store each layer of a writer's KV head group as objects of at
most that many heads, so a reader keeping fewer heads reads only objects of its own heads; 0, the
default, one object per head group; set it to the KV heads per rank of the narrowest reader:
docs/parallelism.md; reads take any).
Keywords only: fingerprint, num_layers, dtype, kv_shape (omit all for admin use, as the CLI does).

The names that load torch (KVStore and the records) are imported on first use, so that reading the
registry (`pdserve.kvstore.registry`, which runs this file first) stays light.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlsplit

from pdserve.kvstore import registry
from pdserve.kvstore.errors import CorruptObject, NotFound, StoreError, StoreTimeout, StoreUnavailable

if TYPE_CHECKING:
    from pdserve.kvstore.base import KVStore
    from pdserve.kvstore.records import ChunkInfo, StoreStats, Usage, VerifyReport

__all__ = ["open_store", "SCHEMES", "KVStore", "ChunkInfo", "StoreStats", "Usage", "VerifyReport",
           "StoreError", "StoreUnavailable", "StoreTimeout", "CorruptObject", "NotFound"]

_LAZY = {"KVStore": "pdserve.kvstore.base", "ChunkInfo": "pdserve.kvstore.records",
         "StoreStats": "pdserve.kvstore.records", "Usage": "pdserve.kvstore.records",
         "VerifyReport": "pdserve.kvstore.records"}
SCHEMES = registry.schemes(registry.store_entries())  # URL schemes open_store accepts


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)


def open_store(url: str, **options: Any) -> KVStore:
    """Open the store at `url`; ValueError for a malformed URL or option, StoreUnavailable if unreachable."""
    parts = urlsplit(url)
    entry = registry.BY_SCHEME.get(parts.scheme.lower())
    if entry is None or entry.store is None:
        raise ValueError(f"unsupported KV store URL {url!r}: use {registry.url_forms(registry.store_entries())}")
    known = {**registry.COMMON_OPTIONS, **entry.options}
    query: dict[str, Any] = {}
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name not in known:
            raise ValueError(f"unknown option {name!r} in {url!r}; known: {', '.join(sorted(known))}")
        try:
            query[name] = known[name](value)
        except ValueError as exc:
            raise ValueError(f"bad value for {name} in {url!r}: {exc}") from exc
    query.update(options)
    target = entry.target(parts, url)  # before the import: a malformed URL fails without loading a backend
    return entry.store_class()(target, **query)
