"""The store's guarantees seen through the connector: exact tokens when an object lies under the wrong
key, and a Redis Cluster hand-off that survives a master failover (engines in this process)."""
from __future__ import annotations

import itertools
import shutil
import time
import pytest

from pdserve.deploy.redis_servers import RedisClusterServer
from tests.helpers.connector import (FALLBACK_RE, GREEDY, PREFILL, capture, engine_pair, lines, mono_engine, prompt,
                                     token_ids)
from tests.helpers.timing import HANG_S

pytestmark = pytest.mark.timeout(180)


def _decode(producer, consumer, mono, full, caplog, between=lambda: None):
    """Prefill, run `between`, decode: the output must equal a plain engine's; returns (result, fallbacks)."""
    producer.generate([full], PREFILL)
    between()
    capture(caplog)
    caplog.clear()
    out = consumer.generate([full], GREEDY)
    assert token_ids(out) == token_ids(mono.generate([full], GREEDY))
    return out[0], [(reason, n) for _, reason, n in lines(caplog, FALLBACK_RE)]


@pytest.mark.slow  # seconds: outside make test-quick
def test_object_under_another_chunks_key_is_a_corrupt_fallback(tiny_llama, tmp_path, caplog):
    producer, consumer = engine_pair(tiny_llama, f"file://{tmp_path}")
    mono = mono_engine(tiny_llama)
    try:
        donor, victim = prompt(600, seed=60), prompt(600, seed=61)
        producer.generate([donor], PREFILL)
        donor_key = producer.engine.connector.keys_for(donor, None)[1]
        victim_key = producer.engine.connector.keys_for(victim, None)[1]

        def misplace() -> None:  # a valid object of another prompt, same shape, under the victim's key
            (src,) = tmp_path.rglob(f"{donor_key}/3.kv")
            (dst,) = tmp_path.rglob(f"{victim_key}/3.kv")
            shutil.copy(src, dst)

        result, fallbacks = _decode(producer, consumer, mono, victim, caplog, misplace)
        assert fallbacks == [("corrupt", 599)]
        assert result.num_cached_tokens == 0
        assert consumer.engine.connector.metrics.value("pdserve_kv_fallbacks_total", reason="corrupt") == 1
    finally:
        producer.engine.shutdown()
        consumer.engine.shutdown()


@pytest.mark.slow
def test_cluster_handoff_is_exact_through_a_master_failover(tiny_llama, caplog):
    cluster = RedisClusterServer(masters=3, replicas=1, node_timeout_ms=500)
    cluster.start()
    producer, consumer = engine_pair(tiny_llama, cluster.url, load_timeout_s=2.0)
    mono = mono_engine(tiny_llama)
    try:
        full = prompt(700, seed=62)  # 3 chunks: on up to three masters
        result, fallbacks = _decode(producer, consumer, mono, full, caplog)
        assert fallbacks == [] and result.num_cached_tokens == 699

        full = prompt(700, seed=63)
        keys = producer.engine.connector.keys_for(full, None)
        store = producer.engine.connector.store
        result, fallbacks = _decode(producer, consumer, mono, full, caplog,
                                    lambda: cluster.kill(cluster.master_of(store.object_name(keys[0], 0))))
        assert result.num_cached_tokens == 0 and [r for r, _ in fallbacks] in (["unavailable"], ["timeout"])

        deadline = time.monotonic() + HANG_S  # the replica takes over (in seconds): hits resume, outputs stay exact
        for seed in itertools.count(64):  # a new prompt each try: nothing from the local prefix cache
            result, fallbacks = _decode(producer, consumer, mono, prompt(700, seed=seed), caplog)
            if result.num_cached_tokens == 699:
                break
            assert time.monotonic() < deadline, f"no hit {HANG_S:g} s after the failover: {fallbacks}"
            time.sleep(0.5)
    finally:
        producer.engine.shutdown()
        consumer.engine.shutdown()
        cluster.stop()
