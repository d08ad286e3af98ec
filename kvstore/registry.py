"""Every KV store URL scheme pdserve knows, in one table: the one place that knows store URLs.

Each entry says which schemes it covers, what its URL looks like, which connector serves it (pdserve's
StoreConnector over a kvstore backend, or LMCache), the store class `open_store` builds and the URL query
options it parses, and the defaults pdserve owns for it. The store factory (`kvstore.open_store`), the
connector factory (connectors/factory.py), `--kv-transfer-config` (serving/kv_transfer_flag.py), the node
CLI (serving/node.py) and pd-kvstore read it, and every text that lists the accepted URLs is generated
here, so a new scheme is one entry.

Importing this module loads neither torch nor a store client (the classes are named, imported on use), so
a command line can check a URL before anything heavy loads.
"""
from __future__ import annotations

import enum
import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping
from urllib.parse import SplitResult, unquote, urlsplit

from pdserve.common.units import parse_bytes

if TYPE_CHECKING:
    from pdserve.kvstore.base import KVStore

LMCACHE_EXTRA = "pip install 'pdserve[lmcache]'"  # what installs LMCache, which serves the lm:// scheme
Parser = Callable[[str], Any]  # a query option's text -> its value; ValueError says what is wrong


class ServedBy(enum.Enum):
    """Which KV connector serves a scheme (the connector factory picks by this)."""

    STORE = "StoreConnector"  # pdserve's own connector over a kvstore backend (open_store)
    LMCACHE = "LMCacheConnector"  # LMCache's connector; its server speaks LMCache's protocol, not ours


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


def _codec(value: str) -> str:
    # payload_codecs owns the names but imports torch: imported on use so this table stays light.
    from pdserve.kvstore.payload_codecs import check_name

    return check_name(value)


# Options every store class takes (URL query or keyword; keywords win): seconds per operation, I/O threads,
# what writes encode KV with (kvstore/payload_codecs.py) and the heads per stored object (docs/parallelism.md).
COMMON_OPTIONS: Mapping[str, Parser] = {"timeout": float, "io_threads": int, "codec": _codec,
                                        "heads_per_object": _count}


def _file_root(parts: SplitResult, url: str) -> str:
    if parts.netloc not in ("", "localhost") or not parts.path:
        raise ValueError(f"file store URL must be file:///absolute/path, got {url!r}")
    return unquote(parts.path)


def _without_query(parts: SplitResult, url: str) -> str:
    return parts._replace(query="").geturl()  # the options are parsed here, not by redis-py


def port_of(parts: SplitResult, url: str) -> int | None:
    """The URL's port (None: none given); ValueError naming the URL for one that is no number in 0..65535."""
    try:
        return parts.port
    except ValueError as exc:  # urllib's own words ("Port out of range 0-65535") lack the URL
        raise ValueError(f"bad port in {url!r}: {exc}") from None


def _redis_target(parts: SplitResult, url: str) -> str:
    """A redis URL whose path is a database number or nothing (db 0): redis-py reads any other path as db 0."""
    port_of(parts, url)
    db = unquote(parts.path).removeprefix("/")
    if db and not (db.isascii() and db.isdigit()):
        raise ValueError(f"redis URL path must be a database number (redis://host:port/0), got {parts.path!r} "
                         f"in {url!r}")
    return _without_query(parts, url)


@dataclass(frozen=True)
class StoreScheme:
    """One kind of store URL."""

    schemes: tuple[str, ...]  # the plain scheme first, then its variants (TLS) that behave the same
    url: str  # what such a URL looks like, for help and error texts
    served_by: ServedBy
    # "module:Class" that open_store builds (imported on use); None where pdserve has no store class
    # (LMCache's server is LMCache's to talk to).
    store: str | None = None
    options: Mapping[str, Parser] = field(default_factory=dict)  # query options beyond COMMON_OPTIONS
    # The store class's first argument from the URL (query dropped); ValueError for a malformed URL.
    target: Callable[[SplitResult, str], str] = _without_query
    default_host: str | None = None  # where a URL without a host or port goes, where pdserve decides it
    default_port: int | None = None

    def store_class(self) -> type[KVStore]:
        if self.store is None:
            raise ValueError(f"{self.url} is served by {self.served_by.value}, not a pdserve store")
        module, name = self.store.split(":")
        cls: type[KVStore] = getattr(importlib.import_module(module), name)
        return cls

    def address(self, url: str) -> tuple[str, int]:
        """(host, port) of a server URL, the entry's defaults filling what the URL leaves out."""
        parts = urlsplit(url)
        host, port = parts.hostname or self.default_host, port_of(parts, url) or self.default_port
        if host is None or port is None:
            raise ValueError(f"{url!r} names no server: use {self.url}")
        return host, port


_REDIS_OPTIONS: Mapping[str, Parser] = {"ttl": int, "prefix": str, "max_connections": int}

ENTRIES: tuple[StoreScheme, ...] = (
    StoreScheme(("file",), "file:///path", ServedBy.STORE, "pdserve.kvstore.filesystem:FileSystemStore",
                {"max_bytes": parse_bytes, "fsync": _bool}, target=_file_root),
    StoreScheme(("redis", "rediss"), "redis[s]://host:port/db", ServedBy.STORE,
                "pdserve.kvstore.redis_store:RedisStore", _REDIS_OPTIONS, target=_redis_target),
    StoreScheme(("redis+cluster", "rediss+cluster"), "redis[s]+cluster://host:port[,host:port...]/", ServedBy.STORE,
                "pdserve.kvstore.redis_cluster:RedisClusterStore", _REDIS_OPTIONS),
    # An lmcache_server (`lmcache_server HOST PORT cpu`); LMCache reads the URL itself (remote_url).
    StoreScheme(("lm",), "lm://host:port", ServedBy.LMCACHE, default_host="127.0.0.1", default_port=65432),
)
BY_SCHEME: Mapping[str, StoreScheme] = {scheme: entry for entry in ENTRIES for scheme in entry.schemes}


def scheme_of(url: str) -> str:
    """The URL's scheme as the registry keys it (lower case; "" for none or a URL that does not parse, whose
    error open_store or the server's client then names)."""
    try:
        return urlsplit(url).scheme.lower()
    except ValueError:  # e.g. an unclosed [ in the address
        return ""


def lookup(url: str) -> StoreScheme | None:
    """The entry for the URL's scheme; None for a scheme pdserve does not know."""
    return BY_SCHEME.get(scheme_of(url))


def entries(served_by: ServedBy | None = None) -> tuple[StoreScheme, ...]:
    """The entries served by `served_by`, or all of them, in table order."""
    return tuple(e for e in ENTRIES if served_by is None or e.served_by is served_by)


def store_entries() -> tuple[StoreScheme, ...]:
    """The entries open_store builds: those with a pdserve store class."""
    return tuple(e for e in ENTRIES if e.store is not None)


def schemes(selected: tuple[StoreScheme, ...] = ENTRIES) -> tuple[str, ...]:
    """Every scheme of the selected entries, variants included."""
    return tuple(s for e in selected for s in e.schemes)


def either(items: list[str]) -> str:
    """"a", "a or b", "a, b or c": how the texts below list alternatives."""
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


def url_forms(selected: tuple[StoreScheme, ...] = ENTRIES) -> str:
    """The URL shapes of the selected entries: "file:///path, redis[s]://host:port/db or ..."."""
    return either([e.url for e in selected])


def scheme_names(selected: tuple[StoreScheme, ...]) -> str:
    """The plain schemes of the selected entries: "file://, redis:// or redis+cluster://"."""
    return either([f"{e.schemes[0]}://" for e in selected])
