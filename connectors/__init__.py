"""pdserve connectors: implementations of the engine's KV connector interface (engine.kv_connector).

StoreConnector (our kvstore backends) and LMCacheConnector share the chunked hand-off logic
(chunked.py) and the hit/load arithmetic (chunk_math.py); kv_log.py writes the per-request
KV log lines and metrics, kv_hits.py (`pd-kv-hits`) reads those lines back.
"""
