"""Pick the KV connector from `config.kv_transfer`: the ConnectorFactory (engine.kv_connector) that
serving hands to LLMEngine, called once the model runner exists."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pdserve.engine.kv_connector import KVConnectorBase
from pdserve.kvstore import registry
from pdserve.kvstore.registry import ServedBy

if TYPE_CHECKING:
    from pdserve.engine.config import EngineConfig


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
                         "layout-free store (kvstore/layout.py)") from None
    from pdserve.engine.parallel.layout import pp_layer_ranges

    dims = layout.dims
    return KVShard.tp_pp(layout.tp_rank, layout.tp, layout.pp_rank, layout.pp, dims.num_layers, dims.num_kv_heads,
                         stage_layers=pp_layer_ranges(dims.num_layers, layout.pp))


def create_connector(config: EngineConfig, runner: Any) -> KVConnectorBase | None:
    """The store URL's registry entry picks the connector (kvstore/registry.py): file://, redis:// and
    redis+cluster:// -> StoreConnector; lm://host:port, or an LMCache config alone -> LMCacheConnector.

    `runner` supplies fingerprint, dtype, num_layers, num_kv_heads, head_dim and kv_caches.
    """
    kt = config.kv_transfer
    if not kt.enabled:
        return None
    entry = registry.lookup(kt.kv_store) if kt.kv_store else None
    served_by = entry.served_by if entry is not None else None
    part = kv_shard(runner)
    shard = {} if part is None else {"shard": part}  # a single-process engine passes none
    if served_by is ServedBy.LMCACHE or (not kt.kv_store and kt.lmcache_config):
        from pdserve.connectors.lmcache_connector import LMCacheConnector

        connector: KVConnectorBase = LMCacheConnector(config, runner, **shard)
    elif served_by is ServedBy.STORE:
        if kt.lmcache_config:
            raise ValueError(f"lmcache_config applies to LMCache stores "
                             f"({registry.url_forms(registry.entries(ServedBy.LMCACHE))}), not {kt.kv_store!r}")
        from pdserve.connectors.store_connector import StoreConnector

        connector = StoreConnector(config, runner, **shard)
    else:
        raise ValueError(f"unsupported kv_store {kt.kv_store!r}: use {registry.url_forms()}")
    if getattr(runner, "kv_caches", None):
        connector.register_kv_caches(runner.kv_caches)
    return connector
