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


def kv_shard(runner: Any) -> Any:
    """The KV this rank owns under tensor/pipeline parallelism (kvstore.layout.KVShard, from the engine's
    layout, engine/parallel/layout.py); None for a single-process engine."""
    layout = getattr(getattr(runner, "shard", None), "layout", None)
    if layout is None:
        return None
    try:
        from pdserve.kvstore.layout import KVShard
    except ImportError:
        raise ValueError("a KV store with tensor_parallel_size or pipeline_parallel_size > 1 needs the "
                         "layout-free store (kvstore/layout.py, issue 28)") from None
    from pdserve.engine.parallel.layout import pp_layer_ranges

    dims = layout.dims
    return KVShard.tp_pp(layout.tp_rank, layout.tp, layout.pp_rank, layout.pp, dims.num_layers, dims.num_kv_heads,
                         stage_layers=pp_layer_ranges(dims.num_layers, layout.pp))


def create_connector(config: EngineConfig, runner: Any) -> KVConnectorBase | None:
    """file:// and redis:// -> StoreConnector; lm://host:port or an LMCache config -> LMCacheConnector.

    `runner` supplies fingerprint, dtype, num_layers, num_kv_heads, head_dim and kv_caches.
    """
    kt = config.kv_transfer
    if not kt.enabled:
        return None
    scheme = urlsplit(kt.kv_store).scheme.lower() if kt.kv_store else None
    part = kv_shard(runner)
    shard = {} if part is None else {"shard": part}  # a single-process engine passes none
    if scheme in LMCACHE_SCHEMES or (scheme is None and kt.lmcache_config):
        from pdserve.connectors.lmcache_connector import LMCacheConnector

        connector: KVConnectorBase = LMCacheConnector(config, runner, **shard)
    elif scheme in STORE_SCHEMES:
        if kt.lmcache_config:
            raise ValueError(f"lmcache_config applies to LMCache stores (lm://host:port), not {kt.kv_store!r}")
        from pdserve.connectors.store_connector import StoreConnector

        connector = StoreConnector(config, runner, **shard)
    else:
        raise ValueError(f"unsupported kv_store {kt.kv_store!r}: use file:///dir, redis://host:port/db "
                         "or lm://host:port")
    if getattr(runner, "kv_caches", None):
        connector.register_kv_caches(runner.kv_caches)
    return connector
