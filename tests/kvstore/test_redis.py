"""redis:// specifics against a real redis-server: outages, key layout, ttl, damaged values."""
from __future__ import annotations

import logging
import random
import signal
import threading
import time

import numpy as np
import pytest
import redis
import torch
import xxhash

from pdserve.deploy.processes import require_port
from pdserve.kvstore.native_reader import KVReadLibrary
from pdserve.kvstore import CorruptObject, StoreTimeout, StoreUnavailable, resp
from pdserve.kvstore.gate import LoadAbandoned, WriteGate
from pdserve.kvstore.spans import SpanTable
from tests.helpers.kvstore import FP, OTHER_FP, make_chunks, open_test_store, write_all
from tests.helpers.timing import HANG_S


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
        seconds = time.monotonic() - start
        assert seconds < HANG_S, f"{seconds:.0f} s: not bounded by the store's 1 s timeout"
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
        seconds = time.monotonic() - start
        assert seconds < HANG_S, f"{seconds:.0f} s: not bounded by the store's 0.5 s timeout"
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
    from pdserve.deploy.processes import ClusterSpec, LocalCluster
    from pdserve.kvstore import open_store

    cluster = LocalCluster(ClusterSpec(model="unused", log_dir=tmp_path, store="redis", redis_maxmemory="64mb"))
    cluster.store_server.start()  # only the redis-server of `make serve ARGS="--store redis"`
    try:
        require_port(int(cluster.kv_store.rsplit(":", 1)[1].split("/")[0]))
        with open_store(cluster.kv_store, timeout=10) as store:
            assert store.bounds_warning() is None
            info = store._redis.info("memory")
            assert (info["maxmemory"], info["maxmemory_policy"]) == (64 * 2**20, "allkeys-lru")
    finally:
        cluster.store_server.stop()


def test_node_start_up_check_warns_once_about_an_unbounded_store(redis_server, tmp_path, caplog):
    from pdserve.serving.node import check_store

    caplog.set_level(logging.WARNING)
    for url in (redis_server.url, redis_server.url + "?ttl=60", f"file://{tmp_path}?max_bytes=1GiB"):
        check_store(url)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(f"KV store {redis_server.url} is unbounded")


# ---- the compiled receiver of loads (kvstore/csrc/kv_recv.c through kvstore.resp.get_table) ----
@pytest.fixture(scope="module")
def compiled_reader(tmp_path_factory):
    return KVReadLibrary(tmp_path_factory.mktemp("kernels"))


def _scattered_table(region: memoryview, sizes: list[int], rng: random.Random) -> SpanTable:
    """Pieces of random lengths (some empty) at shuffled, disjoint places of `region`: object i's pieces
    hold sizes[i] bytes."""
    lengths = []
    for size in sizes:
        cuts = sorted(rng.randrange(size + 1) for _ in range(rng.choice([0, 1, 5, 40, 1500])))
        lengths.append([b - a for a, b in zip([0, *cuts], [*cuts, size])])
    order = list(range(sum(map(len, lengths))))
    rng.shuffle(order)
    flat = [n for row in lengths for n in row]
    offsets, at = [0] * len(flat), 0
    for k in order:
        offsets[k] = at
        at += flat[k] + 1  # one byte between pieces: a write past a piece shows
    assert at <= region.nbytes
    desc = np.array([(0, o, n) for o, n in zip(offsets, flat)], np.int64).reshape(-1, 3)
    return SpanTable([region], desc, np.cumsum([0] + [len(row) for row in lengths], dtype=np.int64))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.slow  # seconds: outside make test-quick
def test_compiled_receiver_lands_each_value_of_a_pipeline_in_its_spans(redis_server, compiled_reader, seed):
    """Values of every size (more than a socket buffer, less than a framing read, header only) land
    whole in header and spans with their xxh3; a missing key and a value of the wrong size are told
    apart and write nothing; the connection stays in step for the next pipeline."""
    rng = random.Random(seed)
    client = redis.Redis(port=redis_server.port, socket_timeout=30)
    payloads = [rng.randbytes(n) for n in (3_000_000, 100, 0, 70_000, 5000, 1_000_000)]
    names = [f"v{i}" for i in range(len(payloads) + 2)]
    for name, payload in zip(names, payloads):
        client.set(name, rng.randbytes(64) + payload)
    client.set(names[-2], rng.randbytes(64 + 99))  # expected 64 + 100 bytes: read past
    expect = [len(p) for p in payloads] + [0, 100]  # the last key does not exist
    region = memoryview(bytearray(sum(expect) + 5000))
    for round_ in range(2):  # the same pooled connection twice: still in step
        region[:] = b"\x5a" * region.nbytes
        table = _scattered_table(region, expect, rng)
        headers = np.zeros(64 * len(names), np.uint8)
        sizes, digests = resp.get_table(client, names, table, headers, WriteGate(), compiled_reader)
        assert sizes == [64 + len(p) for p in payloads] + [64 + 99, None]
        for i, (name, payload) in enumerate(zip(names, payloads)):
            value = client.get(name)
            assert bytes(headers[64 * i:64 * (i + 1)]) == value[:64]
            assert b"".join(table.views()[i]) == payload
            assert digests[i] == xxhash.xxh3_64(value[:56] + payload).intdigest()
        assert all(bytes(view) == b"\x5a" * view.nbytes for i in (6, 7) for view in table.views()[i])
        assert digests[6:] == [0, 0]
        gaps = np.ones(region.nbytes, bool)
        for _, offset, nbytes in table.desc.tolist():
            gaps[offset:offset + nbytes] = False
        assert (np.frombuffer(region, np.uint8)[gaps] == 0x5A).all()  # nothing written between the pieces


def test_compiled_receiver_reads_past_an_error_reply(redis_server, compiled_reader):
    client = redis.Redis(port=redis_server.port, socket_timeout=30)
    client.set("good", b"h" * 64 + b"p" * 10)
    client.rpush("alist", b"x")
    region = memoryview(bytearray(20))
    table = SpanTable([region], np.array([[0, 0, 10], [0, 10, 10]], np.int64), np.array([0, 1, 2], np.int64))
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        resp.get_table(client, ["alist", "good"], table, np.zeros(128, np.uint8), WriteGate(), compiled_reader)
    assert bytes(region) == b"\0" * 10 + b"p" * 10  # the value after the error reply was read all the same
    region[:] = b"\0" * 20
    sizes, _ = resp.get_table(client, ["good", "good"], table, np.zeros(128, np.uint8), WriteGate(), compiled_reader)
    assert sizes == [74, 74] and bytes(region) == b"p" * 20


def test_a_gate_closed_mid_reply_stops_every_write_at_once(redis_server, compiled_reader):
    """The load's gate closes while its replies are half received and redis is frozen: close() returns,
    the read ends with LoadAbandoned at once (not at its 60 s timeout), and nothing lands after close()
    returned, although redis, thawed, sends every remaining byte."""
    client = redis.Redis(port=redis_server.port, socket_timeout=30)
    size = 8 << 20
    names = [f"big{i}" for i in range(8)]  # 64 MiB: far more than the socket buffers hold
    for name in names:
        client.set(name, b"h" * 64 + bytes([1 + len(name)]) * size)
    store = open_test_store(redis_server.url, 1, timeout=60.0)
    region = memoryview(bytearray(len(names) * size))
    table = SpanTable([region], np.array([(0, i * size, size) for i in range(len(names))], np.int64),
                      np.arange(len(names) + 1, dtype=np.int64))
    watched = np.frombuffer(region, np.uint8)
    gate, outcome = WriteGate(), []

    def read() -> None:
        try:
            resp.get_table(store._redis, names, table, np.zeros(64 * len(names), np.uint8), gate, compiled_reader)
        except BaseException as exc:  # noqa: BLE001 (the outcome is the assertion)
            outcome.append(exc)

    thread = threading.Thread(target=read)
    thread.start()
    try:
        while not watched[size // 2]:  # the first value is half in: freeze redis mid-stream
            time.sleep(0.0005)
        redis_server.proc.send_signal(signal.SIGSTOP)
        gate.close()
        landed = watched.copy()
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)
    thread.join(HANG_S)
    assert not thread.is_alive() and isinstance(outcome[0], LoadAbandoned)
    assert 0 < int(np.count_nonzero(landed)) < region.nbytes  # it really was cut mid-stream
    time.sleep(0.2)
    assert np.array_equal(watched, landed)
    store.close()


def test_a_frozen_server_times_out_the_compiled_receiver(redis_server, compiled_reader):
    keys, layers = make_chunks(40, 1)
    store = open_test_store(redis_server.url, 1, timeout=0.5)
    store.span_reader = compiled_reader
    write_all(store, keys, layers)
    lens = [layers[0][key].shape[1] for key in keys]
    staging = torch.zeros(2, sum(lens), *layers[0][keys[0]].shape[2:])
    flat = memoryview(staging.view(torch.uint8).numpy()).cast("B")
    row = flat.nbytes // (2 * sum(lens))
    pieces, first, start = [], [0], 0
    for n in lens:
        pieces += [(0, start * row, n * row), (0, flat.nbytes // 2 + start * row, n * row)]
        first.append(len(pieces))
        start += n
    table = SpanTable([flat], np.array(pieces, np.int64), np.array(first, np.int64))
    redis_server.proc.send_signal(signal.SIGSTOP)
    try:
        start_s = time.monotonic()
        with pytest.raises(StoreTimeout):
            store.get_layer_spans(0, keys, table, lens, WriteGate())
        seconds = time.monotonic() - start_s
        assert seconds < HANG_S, f"{seconds:.0f} s: not bounded by the store's 0.5 s timeout"
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)
    assert store.get_layer_spans(0, keys, table, lens, WriteGate()) == staging.nbytes
    assert torch.equal(staging, torch.cat([layers[0][key] for key in keys], dim=1))
    store.close()
