"""redis+cluster:// against a real Redis Cluster: slot placement, per-node batching, failover, pd-kvstore."""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import redis
import torch

from pdserve.deploy.redis_servers import RedisClusterServer
from pdserve.kvstore import CorruptObject, NotFound, StoreError, StoreTimeout, StoreUnavailable, open_store
from pdserve.kvstore.cli import main
from tests.helpers.kvstore import FP, PYTHON, make_chunks, open_test_store, write_all
from tests.helpers.timing import HANG_S

REPO = Path(__file__).resolve().parents[2]
LAYERS = 2


def _masters(cluster: RedisClusterServer) -> list[redis.Redis]:
    return [n.client() for n in cluster.nodes[:cluster.masters]]


def _keys_in_slot(master: redis.Redis, slot: int) -> set[str]:
    return {k if isinstance(k, str) else k.decode() for k in master.execute_command("CLUSTER GETKEYSINSLOT", slot, 100)}


def test_a_chunk_lives_in_one_slot_and_chunks_spread_over_the_masters(redis_cluster):
    keys, layers = make_chunks(16 * 12, LAYERS)
    with open_test_store(redis_cluster.url, LAYERS) as store:
        write_all(store, keys, layers)
        masters = _masters(redis_cluster)
        holders = []
        for key in keys:
            names = [store.object_name(key, i) for i in range(LAYERS)] + [f"pdkv:{FP}:{{{key}}}:c"]
            (slot,) = {masters[0].cluster("keyslot", n) for n in names}
            found = [m for m in masters if _keys_in_slot(m, slot) == set(names)]
            assert len(found) == 1  # layers and commit marker together, on one master
            holders.append(found[0].connection_pool.connection_kwargs["port"])
        assert len(set(holders)) == 3  # 12 chunks: every master holds some

        before = [m.info("commandstats").get("cmdstat_get", {}).get("calls", 0) for m in masters]
        rows = store.get_layers(range(LAYERS), keys)  # one call, every (layer, chunk)
        assert all(torch.equal(t, layers[i][k]) for i, row in enumerate(rows) for t, k in zip(row, keys))
        after = [m.info("commandstats").get("cmdstat_get", {}).get("calls", 0) for m in masters]
        port_of = [m.connection_pool.connection_kwargs["port"] for m in masters]
        # each master served exactly the GETs of its own chunks: no redirects, nothing sent twice
        assert [a - b for a, b in zip(after, before)] == [LAYERS * holders.count(p) for p in port_of]


def test_misplaced_object_is_corrupt_and_verify_names_it(redis_cluster):
    keys, layers = make_chunks(32, LAYERS)
    with open_test_store(redis_cluster.url, LAYERS) as store:
        write_all(store, keys, layers)
        client = redis.RedisCluster.from_url(redis_cluster.url.replace("redis+cluster", "redis").split(",")[0] + "/")
        client.set(store.object_name(keys[1], 0), client.get(store.object_name(keys[0], 0)))  # same shape, other key
        with pytest.raises(CorruptObject, match="another chunk or layer"):
            store.get_layer(0, keys)
        report = store.verify()
        assert report.objects == 2 * LAYERS and report.corrupt == [
            f"{store.object_name(keys[1], 0)}: a valid object of another chunk or layer, stored under the wrong key"]
        client.close()


@pytest.mark.slow  # seconds: outside make test-quick
def test_pd_kvstore_works_on_a_cluster(redis_cluster, capsys):
    keys, layers = make_chunks(40, LAYERS, torch.bfloat16)
    write_all(open_test_store(redis_cluster.url, LAYERS, torch.bfloat16), keys, layers)
    done = subprocess.run([PYTHON, "-m", "pdserve.kvstore.cli", redis_cluster.url, "stats", "--json"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    stats = json.loads(done.stdout)[FP]
    assert (stats["chunks"], stats["objects"]) == (3, 6) and stats["bytes"] > 0
    assert stats["committed_bytes"] == stats["bytes"] and stats["inflight_bytes"] == 0, stats
    assert main([redis_cluster.url, "ls"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3
    assert main([redis_cluster.url, "verify"]) == 0
    assert "verified 6 object(s)" in capsys.readouterr().out
    assert main([redis_cluster.url, "clear"]) == 0
    assert "removed 6 object(s)" in capsys.readouterr().out
    assert sum(m.dbsize() for m in _masters(redis_cluster)) == 0


def test_bounds_warning_names_an_unbounded_cluster(redis_cluster):
    with open_store(redis_cluster.url) as store:
        assert "unbounded" in store.bounds_warning()
    with open_store(redis_cluster.url + "?ttl=60") as store:
        assert store.bounds_warning() is None
    for m in _masters(redis_cluster):
        m.config_set("maxmemory", "64mb")
        m.config_set("maxmemory-policy", "allkeys-lru")
    try:
        with open_store(redis_cluster.url) as store:
            assert store.bounds_warning() is None
    finally:
        for m in _masters(redis_cluster):
            m.config_set("maxmemory", "0")
            m.config_set("maxmemory-policy", "noeviction")


def test_unreachable_cluster_is_unavailable_and_bad_urls_are_value_errors():
    from pdserve.deploy.processes import free_port

    url = f"redis+cluster://127.0.0.1:{free_port()},127.0.0.1:{free_port()}/"
    with open_test_store(url, LAYERS, timeout=1.0) as store:  # opening never blocks on the cluster
        start = time.monotonic()
        with pytest.raises(StoreUnavailable, match="unreachable"):
            store.lookup(["abc"])
        seconds = time.monotonic() - start
        assert seconds < HANG_S, f"{seconds:.0f} s: not bounded by the store's 1 s timeout"
        assert store.bounds_warning() is None  # cannot tell: no claim
    for bad in ("redis+cluster://127.0.0.1/", "redis+cluster://127.0.0.1:1,:2/", "redis+cluster://127.0.0.1:1/3"):
        with pytest.raises(ValueError):
            open_store(bad)


@pytest.mark.slow
def test_master_failover_is_a_fallback_then_hits_resume():
    cluster = RedisClusterServer(masters=3, replicas=1, node_timeout_ms=500)
    cluster.start()
    try:
        keys, layers = make_chunks(16 * 9, LAYERS)
        store = open_test_store(cluster.url, LAYERS, timeout=1.0)
        write_all(store, keys, layers)
        cluster.replicate()
        victim = cluster.master_of(store.object_name(keys[0], 0))
        cluster.kill(victim)
        # node_timeout_ms=500: a replica takes over within seconds; a cluster that never does fails here
        outcomes, started = [], time.monotonic()
        while time.monotonic() - started < HANG_S:
            call = time.monotonic()
            try:
                hit = store.lookup(keys)
                rows = store.get_layers(range(LAYERS), keys[:hit])
            except (StoreUnavailable, StoreTimeout) as exc:
                outcomes.append(type(exc).__name__)
            else:
                if hit == len(keys):
                    break
                outcomes.append(f"hit {hit}")
            assert time.monotonic() - call < HANG_S  # every call bounded by the 1 s timeout, never a hang
            time.sleep(0.1)
        else:
            pytest.fail(f"the cluster did not recover within {HANG_S:g} s: {outcomes[-5:]}")
        assert {"StoreUnavailable", "StoreTimeout"} & set(outcomes), outcomes  # the outage was seen as one
        # the promoted replica had every committed chunk: whole chunks, the same bytes
        assert all(torch.equal(t, layers[i][k]) for i, row in enumerate(rows) for t, k in zip(row, keys))
        assert cluster.master_of(store.object_name(keys[0], 0)) is not victim
        new_keys, new_layers = make_chunks(48, LAYERS, seed=7)
        write_all(store, new_keys, new_layers)  # saves work again
        assert store.lookup(new_keys) == 3
        store.close()
    finally:
        cluster.stop()


def test_errors_inside_a_batch_surface_as_store_errors(redis_cluster):
    keys, layers = make_chunks(32, LAYERS)
    with open_test_store(redis_cluster.url, LAYERS) as store:
        write_all(store, keys, layers)
        store.delete(keys[:1])
        with pytest.raises(NotFound):
            store.get_layers(range(LAYERS), keys)
        assert isinstance(NotFound("x"), StoreError)
