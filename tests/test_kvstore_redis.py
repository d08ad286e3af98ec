"""redis:// specifics against a real redis-server: outages, key layout, ttl, damaged values."""
from __future__ import annotations

import logging
import signal
import time

import pytest
import redis
import torch

from kvstore import CorruptObject, StoreTimeout, StoreUnavailable
from tests.kvstore_helpers import FP, OTHER_FP, make_chunks, open_test_store, write_all
from tests.utils import wait_for_port


def test_outage_is_unavailable_within_the_timeout_and_the_same_store_recovers(redis_server):
    keys, layers = make_chunks(32, 2)
    store = open_test_store(redis_server.url, 2, timeout=1.0)
    write_all(store, keys, layers)
    staging = torch.empty(2, 32, *layers[0][keys[0]].shape[2:])
    store.get_layer_into(0, keys, staging, [16, 16])  # leaves a pooled connection that the restart breaks
    redis_server.stop()
    for call in (lambda: store.lookup(keys), lambda: store.get_layer(0, keys),
                 lambda: store.get_layer_into(0, keys, staging, [16, 16]), lambda: write_all(store, keys, layers)):
        start = time.monotonic()
        with pytest.raises(StoreUnavailable, match="unreachable"):
            call()
        assert time.monotonic() - start < 5.0  # bounded by the 1 s timeout (generous for a loaded machine)
    redis_server.start()  # a fresh, empty server on the same port
    assert store.lookup(keys) == 0
    write_all(store, keys, layers)
    assert store.lookup(keys) == 2
    assert torch.equal(store.get_layer(1, keys)[1], layers[1][keys[1]])
    store.get_layer_into(1, keys, staging, [16, 16])
    assert torch.equal(staging, torch.cat([layers[1][k] for k in keys], dim=1))


def test_frozen_server_is_a_timeout_not_a_hang(redis_server):
    keys, layers = make_chunks(16, 1)
    store = open_test_store(redis_server.url, 1, timeout=0.5)
    write_all(store, keys, layers)
    redis_server.proc.send_signal(signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(StoreTimeout):
            store.get_layer(0, keys)
        with pytest.raises(StoreTimeout):  # the load path's own reply reader is bounded the same way
            store.get_layer_into(0, keys, torch.empty(2, 16, *layers[0][keys[0]].shape[2:]), [16])
        assert time.monotonic() - start < 5.0
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)
    assert torch.equal(store.get_layer(0, keys)[0], layers[0][keys[0]])


def test_keys_share_a_hash_tag_per_chunk_and_respect_prefix_and_ttl(redis_server):
    keys, layers = make_chunks(20, 2)
    store = open_test_store(redis_server.url + "?prefix=t1:&ttl=300", 2)
    write_all(store, keys, layers)
    client = redis.Redis(port=redis_server.port)
    names = sorted(k.decode() for k in client.keys("*"))
    assert names == sorted(f"t1:{FP}:{{{key}}}:{s}" for key in keys for s in ("0", "1", "c"))
    assert all(0 < client.ttl(name) <= 300 for name in names)
    other = open_test_store(redis_server.url, 2)  # default prefix: a separate namespace
    assert other.lookup(keys) == 0


def test_damaged_or_foreign_values_are_corrupt(redis_server):
    keys, layers = make_chunks(16, 1)
    store = open_test_store(redis_server.url, 1)
    write_all(store, keys, layers)
    client = redis.Redis(port=redis_server.port)
    name = f"pdkv:{FP}:{{{keys[0]}}}:0"
    value = bytearray(client.get(name))
    value[100] ^= 4
    client.set(name, bytes(value))
    staging = torch.empty(2, 16, *layers[0][keys[0]].shape[2:])
    with pytest.raises(CorruptObject, match="checksum"):
        store.get_layer(0, keys)
    with pytest.raises(CorruptObject, match="checksum"):  # the decode hot path checks the same
        store.get_layer_into(0, keys, staging, [16])
    assert len(store.verify().corrupt) == 1
    client.set(name, bytes(value[:-1]))
    with pytest.raises(CorruptObject):
        store.get_layer(0, keys)
    with pytest.raises(CorruptObject, match="bytes, expected"):
        store.get_layer_into(0, keys, staging, [16])
    value[100] ^= 4  # repaired: the pooled connection read past the short value and is still in step
    client.set(name, bytes(value))
    store.get_layer_into(0, keys, staging, [16])
    assert torch.equal(staging, layers[0][keys[0]])
    foreign = open_test_store(redis_server.url, 1, fingerprint=OTHER_FP)
    write_all(foreign, keys, layers)
    client.set(name, client.get(f"pdkv:{OTHER_FP}:{{{keys[0]}}}:0"))
    with pytest.raises(CorruptObject, match="written for model"):
        store.get_layer(0, keys)


def test_valid_value_under_another_chunks_key_is_corrupt(redis_server):
    keys, layers = make_chunks(32, 1)
    store = open_test_store(redis_server.url, 1)
    write_all(store, keys, layers)
    client = redis.Redis(port=redis_server.port)
    client.set(f"pdkv:{FP}:{{{keys[1]}}}:0", client.get(f"pdkv:{FP}:{{{keys[0]}}}:0"))
    with pytest.raises(CorruptObject, match="another chunk or layer"):
        store.get_layers([0], keys)
    assert store.verify().corrupt == [f"pdkv:{FP}:{{{keys[1]}}}:0: a valid object of another chunk or layer, "
                                      "stored under the wrong key"]


def test_bounds_warning_says_when_redis_can_grow_without_limit(redis_server):
    client = redis.Redis(port=redis_server.port)
    with open_test_store(redis_server.url, 1) as store:
        assert "unbounded" in store.bounds_warning() and "maxmemory" in store.bounds_warning()
        client.config_set("maxmemory", "64mb")  # bounded, but the default policy refuses writes when full
        assert "noeviction" in store.bounds_warning()
        client.config_set("maxmemory-policy", "allkeys-lru")
        assert store.bounds_warning() is None
        client.config_set("maxmemory", "0")
    with open_test_store(redis_server.url + "?ttl=60", 1) as store:
        assert store.bounds_warning() is None


def test_make_serve_starts_a_bounded_redis(tmp_path):
    from deploy.processes import ClusterSpec, LocalCluster
    from kvstore import open_store

    cluster = LocalCluster(ClusterSpec(model="unused", log_dir=tmp_path, store="redis", redis_maxmemory="64mb"))
    cluster.store_server.start()  # only the redis-server of `make serve ARGS="--store redis"`
    try:
        wait_for_port(int(cluster.kv_store.rsplit(":", 1)[1].split("/")[0]))
        with open_store(cluster.kv_store, timeout=10) as store:
            assert store.bounds_warning() is None
            info = store._redis.info("memory")
            assert (info["maxmemory"], info["maxmemory_policy"]) == (64 * 2**20, "allkeys-lru")
    finally:
        cluster.store_server.stop()


def test_node_start_up_check_warns_once_about_an_unbounded_store(redis_server, tmp_path, caplog):
    from serving.node import check_store

    caplog.set_level(logging.WARNING)
    for url in (redis_server.url, redis_server.url + "?ttl=60", f"file://{tmp_path}?max_bytes=1GiB"):
        check_store(url)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(f"KV store {redis_server.url} is unbounded")
