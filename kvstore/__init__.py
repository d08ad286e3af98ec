"""pdserve kvstore: chunked per-layer KV objects in a shared store (see kvstore.base for the API).

open_store(url, **options) picks the backend from the URL scheme:
    file:///path?max_bytes=64GiB&fsync=0          FileSystemStore (local disk or NFS)
    redis://host:port/db?ttl=3600&prefix=pdkv:    RedisStore (rediss:// for TLS)
    redis+cluster://host:port[,host:port...]/?ttl=3600&prefix=pdkv:
                                                  RedisClusterStore (rediss+cluster:// for TLS)
Common options (URL query or keyword; keywords win): timeout (seconds), io_threads, codec (what writes
encode KV with: raw, the default; lossless; int8; fp8 — kvstore/kv_codecs.py; reads take any),
heads_per_object (an integer >= 0: writes store each layer of a writer's KV head group as objects of at
most that many heads, so a reader keeping fewer heads reads only objects of its own heads; 0, the
default, one object per head group; set it to the KV heads per rank of the narrowest reader:
docs/parallelism.md; reads take any).
Keywords only: fingerprint, num_layers, dtype, kv_shape (omit all for admin use, as the CLI does).
"""
from __future__ import annotations

from typing import Any, Callable
from urllib.parse import parse_qsl, unquote, urlsplit

from pdserve.common.units import parse_bytes
from pdserve.kvstore.base import KVStore
from pdserve.kvstore.kv_codecs import check_name
from pdserve.kvstore.records import ChunkInfo, StoreStats, Usage, VerifyReport
from pdserve.kvstore.errors import CorruptObject, NotFound, StoreError, StoreTimeout, StoreUnavailable

__all__ = ["open_store", "SCHEMES", "KVStore", "ChunkInfo", "StoreStats", "Usage", "VerifyReport",
           "StoreError", "StoreUnavailable", "StoreTimeout", "CorruptObject", "NotFound"]


def _bool(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (1/0/true/false), got {value!r}")


def _count(value: str) -> int:
    number = int(value)
    if number < 0:
        raise ValueError(f"expected an integer >= 0, got {value!r}")
    return number


_COMMON: dict[str, Callable[[str], Any]] = {"timeout": float, "io_threads": int, "codec": check_name,
                                            "heads_per_object": _count}
_QUERY: dict[str, dict[str, Callable[[str], Any]]] = {
    "file": {"max_bytes": parse_bytes, "fsync": _bool},
    "redis": {"ttl": int, "prefix": str, "max_connections": int},
}
_QUERY["rediss"] = _QUERY["redis"]  # TLS
_QUERY["redis+cluster"] = _QUERY["rediss+cluster"] = _QUERY["redis"]
SCHEMES = tuple(_QUERY)  # URL schemes open_store accepts


def open_store(url: str, **options: Any) -> KVStore:
    """Open the store at `url`; ValueError for a malformed URL or option, StoreUnavailable if unreachable."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _QUERY:
        raise ValueError(f"unsupported KV store URL {url!r}: use file:///path, redis[s]://host:port/db or "
                         "redis[s]+cluster://host:port[,host:port...]/")
    known = {**_COMMON, **_QUERY[scheme]}
    query: dict[str, Any] = {}
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name not in known:
            raise ValueError(f"unknown option {name!r} in {url!r}; known: {', '.join(sorted(known))}")
        try:
            query[name] = known[name](value)
        except ValueError as exc:
            raise ValueError(f"bad value for {name} in {url!r}: {exc}") from exc
    query.update(options)
    if scheme == "file":
        from pdserve.kvstore.filesystem import FileSystemStore

        if parts.netloc not in ("", "localhost") or not parts.path:
            raise ValueError(f"file store URL must be file:///absolute/path, got {url!r}")
        return FileSystemStore(unquote(parts.path), **query)
    url = parts._replace(query="").geturl()
    if scheme.endswith("+cluster"):
        from pdserve.kvstore.redis_cluster import RedisClusterStore

        return RedisClusterStore(url, **query)
    from pdserve.kvstore.redis_store import RedisStore

    return RedisStore(url, **query)
