"""vLLM's `--kv-transfer-config` JSON on the node commands, mapped onto pdserve's own KV options.

A vLLM user's habit,

    pd-decode --kv-transfer-config '{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_consumer",
                                     "kv_connector_extra_config": {"kv_store": "lm://10.0.0.5:65432"}}'

means exactly `pd-decode --kv-store lm://10.0.0.5:65432 --kv-role kv_consumer`: the JSON only fills the
node's options (docs/configuration.md has the table). Nothing in it is ignored: a connector, key or extra
key without a pdserve meaning is an error naming it, and so is a setting given both in the JSON and as its
own flag. Parsing imports nothing heavy, so a bad value fails in milliseconds.
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from pdserve.engine.config import KVRole
from pdserve.kvstore import registry
from pdserve.kvstore.registry import ServedBy

# Node option dest -> its own flag (for the "given twice" error).
FLAGS = {"kv_store": "--kv-store", "kv_role": "--kv-role", "chunk_size": "--chunk-size",
         "lmcache_config": "--lmcache-config", "load_timeout_s": "--kv-load-timeout"}
TOP_LEVEL_KEYS = ("kv_connector", "kv_role", "kv_connector_extra_config")


def _text(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"kv_connector_extra_config.{key} must be a non-empty string, got {value!r}")
    return value


def _positive_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"kv_connector_extra_config.{key} must be an integer >= 1, got {value!r}")
    return value


def _positive_seconds(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"kv_connector_extra_config.{key} must be a positive number of seconds, got {value!r}")
    return float(value)


def _directory_url(key: str, value: Any) -> str:
    return Path(_text(key, value)).expanduser().resolve().as_uri()


@dataclass(frozen=True)
class ExtraKey:
    dest: str  # the node option it sets
    parse: Callable[[str, Any], Any]


_COMMON = {"chunk_size": ExtraKey("chunk_size", _positive_int),
           "kv_load_timeout": ExtraKey("load_timeout_s", _positive_seconds)}

# kv_connector -> the extra config keys it reads. Which connector a store URL picks is the store
# registry's (kvstore/registry.py, read by connectors/factory.py); node start-up checks the URL agrees
# with the name.
CONNECTORS: dict[str, dict[str, ExtraKey]] = {
    # pdserve's own connector over the registry's ServedBy.STORE schemes.
    "StoreConnector": {"kv_store": ExtraKey("kv_store", _text), **_COMMON},
    # vLLM's file-based example connector: its directory becomes a file:// store (pdserve's format).
    "SharedStorageConnector": {"shared_storage_path": ExtraKey("kv_store", _directory_url), **_COMMON},
    # LMCache: a ServedBy.LMCACHE server (lm://host:port) and/or LMCache's YAML config.
    "LMCacheConnectorV1": {"kv_store": ExtraKey("kv_store", _text),
                           "lmcache_config": ExtraKey("lmcache_config", _text), **_COMMON},
}
LMCACHE_CONNECTORS = ("LMCacheConnectorV1",)  # the names whose store URLs the registry marks ServedBy.LMCACHE


def _lmcache_urls() -> str:
    return registry.url_forms(registry.entries(ServedBy.LMCACHE))


def _options(config: Any) -> dict[str, Any]:
    """The JSON object -> {node option dest: value}; ValueError names what is wrong."""
    if not isinstance(config, dict):
        raise ValueError(f"expected a JSON object, got {type(config).__name__}")
    unknown = [k for k in config if k not in TOP_LEVEL_KEYS]
    if unknown:
        raise ValueError(f"unsupported key {unknown[0]!r} (pdserve reads {', '.join(TOP_LEVEL_KEYS)})")
    name = config.get("kv_connector")
    if not isinstance(name, str) or name not in CONNECTORS:
        raise ValueError(f"unsupported kv_connector {name!r}: pdserve has {', '.join(CONNECTORS)}")
    extra = config.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ValueError(f"kv_connector_extra_config must be a JSON object, got {type(extra).__name__}")
    keys = CONNECTORS[name]
    options: dict[str, Any] = {}
    for key, value in extra.items():
        if key not in keys:
            raise ValueError(f"unsupported kv_connector_extra_config key {key!r} for {name} "
                             f"(it reads {', '.join(keys)})")
        options[keys[key].dest] = keys[key].parse(key, value)
    if config.get("kv_role") is not None:
        options["kv_role"] = KVRole.parse(config["kv_role"]).value
    if name in LMCACHE_CONNECTORS and "lmcache_config" not in options and os.environ.get("LMCACHE_CONFIG_FILE"):
        options["lmcache_config"] = os.environ["LMCACHE_CONFIG_FILE"]  # where vLLM's LMCache connector looks
    if name in LMCACHE_CONNECTORS and "kv_store" not in options and "lmcache_config" not in options:
        raise ValueError(f"{name} needs kv_connector_extra_config.kv_store ({_lmcache_urls()}), "
                         "kv_connector_extra_config.lmcache_config (a YAML file) or LMCACHE_CONFIG_FILE")
    options["kv_connector"] = name
    return options


def parse_kv_transfer_config(text: str) -> dict[str, Any]:
    """argparse type of --kv-transfer-config: the JSON -> {node option dest: value} plus kv_connector."""
    try:
        config = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from None
    try:
        return _options(config)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


parse_kv_transfer_config.__name__ = "JSON object"


def apply_kv_transfer_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str | None:
    """Copy the parsed JSON into the node's options (a setting given twice is a usage error); the connector."""
    options = dict(args.kv_transfer_config or {})
    connector = options.pop("kv_connector", None)
    for dest, value in options.items():
        if getattr(args, dest) is not None:
            parser.error(f"argument --kv-transfer-config: {FLAGS[dest]} is given both in the JSON and as a flag; "
                         "give it once")
        setattr(args, dest, value)
    return connector


def check_connector_store(connector: str, kv_store: str | None, lmcache_config: str | None) -> None:
    """The node's store must pick the named connector (the factory picks by the URL's registry entry);
    ValueError if not."""
    lmcache = connector in LMCACHE_CONNECTORS
    if not lmcache and lmcache_config:
        raise ValueError(f"kv_connector {connector} takes no LMCache config (that is LMCacheConnectorV1's)")
    if kv_store is None:
        return
    entry = registry.lookup(kv_store)
    if lmcache != (entry is not None and entry.served_by is ServedBy.LMCACHE):
        stores, lmcaches = (registry.scheme_names(registry.entries(s)) for s in (ServedBy.STORE, ServedBy.LMCACHE))
        wanted = f"an {_lmcache_urls()} store" if lmcache else \
            f"a {stores} store ({lmcaches} is {LMCACHE_CONNECTORS[0]}'s)"
        raise ValueError(f"kv_connector {connector} takes {wanted}, got {kv_store!r}")
