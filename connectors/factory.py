"""Pick the KV connector from `config.kv_transfer`: the ConnectorFactory (engine.kv_connector) that
serving hands to LLMEngine, called once the model runner exists."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from pdserve.engine.kv_connector import KVConnectorBase
from pdserve.kvstore import SCHEMES as STORE_SCHEMES

if TYPE_CHECKING:
    from pdserve.engine.config import EngineConfig

LMCACHE_SCHEMES = ("lm",)


def create_connector(config: EngineConfig, runner: Any) -> KVConnectorBase | None:
    """file:// and redis:// -> StoreConnector; lm://host:port or an LMCache config -> LMCacheConnector.

    `runner` supplies fingerprint, dtype, num_layers, num_kv_heads, head_dim and kv_caches.
    """
    kt = config.kv_transfer
    if not kt.enabled:
        return None
    scheme = urlsplit(kt.kv_store).scheme.lower() if kt.kv_store else None
    if scheme in LMCACHE_SCHEMES or (scheme is None and kt.lmcache_config):
        from pdserve.connectors.lmcache_connector import LMCacheConnector

        connector: KVConnectorBase = LMCacheConnector(config, runner)
    elif scheme in STORE_SCHEMES:
        if kt.lmcache_config:
            raise ValueError(f"lmcache_config applies to LMCache stores (lm://host:port), not {kt.kv_store!r}")
        from pdserve.connectors.store_connector import StoreConnector

        connector = StoreConnector(config, runner)
    else:
        raise ValueError(f"unsupported kv_store {kt.kv_store!r}: use file:///dir, redis://host:port/db "
                         "or lm://host:port")
    if getattr(runner, "kv_caches", None):
        connector.register_kv_caches(runner.kv_caches)
    return connector
