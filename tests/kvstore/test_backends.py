"""Behaviour every backend shares, each against the real thing (a directory, a redis-server, a Redis Cluster)."""
from __future__ import annotations

import signal
import time

import pytest
import torch

from pdserve.kvstore import CorruptObject, NotFound, open_store
from tests.helpers.kvstore import FP, make_chunks, open_test_store, spawn_writer, start, write_all

LAYERS = 3


def _url(request, tmp_path) -> str:
    if request.param == "file":
        return f"file://{tmp_path}/store"
    if request.param == "cluster":
        return request.getfixturevalue("redis_cluster").url
    return request.getfixturevalue("redis_server").url


@pytest.fixture(params=["file", "redis", "cluster"])
def url(request, tmp_path):
    return _url(request, tmp_path)


@pytest.fixture(params=["file", "redis"])
def process_url(request, tmp_path):
    """The writer-process tests (slow: a Python process each) on the two protocols; the cluster adds no
    cross-process path of its own (same keys, same commit, one hash slot per chunk)."""
    return _url(request, tmp_path)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_with_partial_last_chunk(url, dtype):
    keys, layers = make_chunks(40, LAYERS, dtype)  # chunks of 16, 16 and 8 tokens
    with open_test_store(url, LAYERS, dtype) as store:
        write_all(store, keys, layers)
        assert store.lookup(keys) == 3
        for i in range(LAYERS):
            got = store.get_layer(i, keys)
            assert [t.shape[1] for t in got] == [16, 16, 8]
            assert all(_same_bytes(g, layers[i][k]) for g, k in zip(got, keys))
        stats = store.stats()
        assert stats.objects_written == stats.objects_read == 3 * LAYERS and stats.errors == 0


def test_get_into_preallocated_tensors(url):
    keys, layers = make_chunks(40, LAYERS, torch.bfloat16)
    with open_test_store(url, LAYERS, torch.bfloat16) as store:
        write_all(store, keys, layers)
        staging = [torch.empty_like(layers[0][k]) for k in keys]  # reused for every layer
        for i in range(LAYERS):
            got = store.get_layer(i, keys, out=staging)
            assert all(g is s for g, s in zip(got, staging))
            assert all(_same_bytes(s, layers[i][k]) for s, k in zip(staging, keys))
        wrong = [torch.empty(2, 8, *layers[0][keys[0]].shape[2:], dtype=torch.bfloat16)]  # chunk 0 has 16 tokens
        with pytest.raises(CorruptObject, match="expected"):
            store.get_layer(0, keys[:1], out=wrong)
        with pytest.raises(ValueError, match="output tensors"):
            store.get_layer(0, keys, out=staging[:1])


def test_get_layer_into_reads_consecutive_chunks_into_one_buffer(url):
    """The decode hot path: one reused [2, T, H, D] buffer, each chunk in its token slice."""
    keys, layers = make_chunks(40, LAYERS, torch.bfloat16)  # chunks of 16, 16 and 8 tokens
    with open_test_store(url, LAYERS, torch.bfloat16) as store:
        write_all(store, keys, layers)
        staging = torch.full((2, 40, *layers[0][keys[0]].shape[2:]), 7.0, dtype=torch.bfloat16)
        before = store.stats()
        for i in range(LAYERS):
            assert store.get_layer_into(i, keys, staging, [16, 16, 8]) == staging.nbytes
            assert _same_bytes(staging, torch.cat([layers[i][k] for k in keys], dim=1))
        after = store.stats()
        assert after.objects_read - before.objects_read == 3 * LAYERS and after.errors == before.errors
        part = torch.empty(2, 24, *staging.shape[2:], dtype=torch.bfloat16)  # a suffix of the prompt's chunks
        store.get_layer_into(1, keys[1:], part, [16, 8])
        assert _same_bytes(part, torch.cat([layers[1][k] for k in keys[1:]], dim=1))
        with pytest.raises(CorruptObject, match="expected"):  # chunk 2 holds 8 tokens, not 16
            store.get_layer_into(0, keys[1:], torch.empty(2, 32, *staging.shape[2:], dtype=torch.bfloat16), [16, 16])
        with pytest.raises(ValueError, match="chunk lengths"):
            store.get_layer_into(0, keys, staging, [16, 24])
        with pytest.raises(ValueError, match="staging must be"):
            store.get_layer_into(0, keys, staging[:, :32], [16, 16, 8])
        with pytest.raises(ValueError, match="dtype"):
            store.get_layer_into(0, keys, staging.float(), [16, 16, 8])
        store.delete(keys[2:])
        with pytest.raises(NotFound):
            store.get_layer_into(0, keys, staging, [16, 16, 8])
        head = torch.empty(2, 32, *staging.shape[2:], dtype=torch.bfloat16)  # reads after a miss still line up
        store.get_layer_into(2, keys[:2], head, [16, 16])
        assert _same_bytes(head, torch.cat([layers[2][k] for k in keys[:2]], dim=1))


def test_lookup_counts_the_longest_committed_prefix(url):
    keys, layers = make_chunks(80, LAYERS)  # 5 chunks
    with open_test_store(url, LAYERS) as store:
        assert store.lookup(keys) == 0
        for i in range(LAYERS):
            store.put_layer(i, {k: layers[i][k] for k in (keys[0], keys[1], keys[3])})
        store.put_layer(0, {keys[2]: layers[0][keys[2]]})
        assert store.lookup(keys) == 0  # written but uncommitted: invisible
        store.commit([keys[0], keys[1], keys[3]])
        assert store.lookup(keys) == 2  # chunk 2 is not committed, so chunk 3 does not count
        assert store.lookup(keys[3:]) == 1
        with pytest.raises(NotFound):
            store.commit([keys[2], keys[4]])
        assert store.lookup(keys) == 2
        assert store.delete(keys[1:2]) == 1
        assert store.lookup(keys) == 1
        with pytest.raises(NotFound):
            store.get_layer(0, keys[:2])


def test_commit_without_every_layer_keeps_the_chunk_invisible(url):
    keys, layers = make_chunks(32, LAYERS)
    with open_test_store(url, LAYERS) as store:
        store.put_layer(0, layers[0])
        store.put_layer(2, layers[2])
        with pytest.raises(NotFound, match="miss layers"):
            store.commit(keys)
        assert store.lookup(keys) == 0
        store.put_layer(1, layers[1])
        store.commit(keys)
        assert store.lookup(keys) == 2


def test_async_variants_overlap_and_return_the_same_data(url):
    keys, layers = make_chunks(48, LAYERS, torch.bfloat16)
    with open_test_store(url, LAYERS, torch.bfloat16) as store:
        puts = [store.submit(store.put_layer, i, layers[i]) for i in range(LAYERS)]
        for fut in puts:
            store.result(fut)
        store.result(store.submit(store.commit, keys))
        gets = store.get_layers_async(range(LAYERS), keys)
        for i, fut in enumerate(gets):
            assert all(_same_bytes(g, layers[i][k]) for g, k in zip(store.result(fut), keys))


def test_batched_load_lands_every_layer_in_one_staging_buffer_per_layer(url):
    """The decode hot path: all chunks of a prompt, every layer, read into token slices of reused buffers."""
    keys, layers = make_chunks(40, LAYERS, torch.bfloat16)  # chunks of 16, 16 and 8 tokens
    bounds = [(0, 16), (16, 32), (32, 40)]
    with open_test_store(url, LAYERS, torch.bfloat16) as store:
        write_all(store, keys, layers)
        staging = [torch.full((2, 40, *layers[0][keys[0]].shape[2:]), 7.0, dtype=torch.bfloat16)
                   for _ in range(LAYERS)]
        out = [[buf[:, a:b] for a, b in bounds] for buf in staging]
        before = store.stats().objects_read
        futures = store.get_layers_async(range(LAYERS), keys, out=out)
        for i, fut in enumerate(futures):
            got = store.result(fut)
            assert all(g is o for g, o in zip(got, out[i]))
            assert torch.equal(staging[i], torch.cat([layers[i][k] for k in keys], dim=1))
        assert store.stats().objects_read - before == LAYERS * len(keys)
        rows = store.get_layers([2, 0], keys)  # synchronous, fresh tensors, rows in the order asked
        assert all(_same_bytes(g, layers[i][k]) for i, row in zip((2, 0), rows) for g, k in zip(row, keys))
        with pytest.raises(ValueError, match="rows of output"):
            store.get_layers_async(range(LAYERS), keys, out=out[:1])
        with pytest.raises(ValueError, match="out of range"):
            store.get_layers([0, LAYERS], keys)
        store.delete(keys[1:2])
        futures = store.get_layers_async(range(LAYERS), keys, out=out)
        for fut in futures:
            with pytest.raises(NotFound):
                store.result(fut)


def test_foreign_model_or_dtype_is_corrupt_not_garbage(url):
    keys, layers = make_chunks(16, 1, torch.float16)
    with open_test_store(url, 1, torch.float16) as store:
        write_all(store, keys, layers)
    with open_test_store(url, 1, torch.bfloat16) as wrong_dtype:  # same model id, other dtype
        assert wrong_dtype.lookup(keys) == 1
        with pytest.raises(CorruptObject, match="dtype"):
            wrong_dtype.get_layer(0, keys)
        assert wrong_dtype.stats().errors == 1


@pytest.mark.slow
def test_concurrent_writer_processes_leave_a_valid_store(process_url):
    url = process_url
    keys, layers = make_chunks(100, LAYERS)  # what the writer processes write
    writers = [spawn_writer(url, LAYERS, rounds=12) for _ in range(2)]
    start(writers)
    with open_test_store(url, LAYERS) as store:
        while any(w.poll() is None for w in writers):  # read while they write: only whole chunks show up
            n = store.lookup(keys)
            for i in range(LAYERS):
                assert all(_same_bytes(g, layers[i][k]) for g, k in zip(store.get_layer(i, keys[:n]), keys))
            time.sleep(0.005)  # leave the two cores to the writers
        assert [w.wait() for w in writers] == [0, 0]
        assert store.lookup(keys) == len(keys) == 7
        for i in range(LAYERS):
            assert all(_same_bytes(g, layers[i][k]) for g, k in zip(store.get_layer(i, keys), keys))
        report = store.verify()
        assert report.objects == 7 * LAYERS and report.corrupt == []
        assert all(c.committed and c.objects == LAYERS for c in store.list_chunks(FP))


@pytest.mark.slow  # seconds: outside make test-quick
def test_writer_killed_between_layers_leaves_nothing_visible(process_url):
    url = process_url
    keys, layers = make_chunks(100, LAYERS)
    writer = spawn_writer(url, LAYERS, rounds=1, stop_after=2)
    start([writer])
    assert writer.stdout.readline().strip() == "stopped"
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    with open_test_store(url, LAYERS) as store:
        assert store.lookup(keys) == 0
        chunks = store.list_chunks(FP)
        assert len(chunks) == 7 and not any(c.committed for c in chunks)
        assert {c.objects for c in chunks} == {2}
        with pytest.raises(NotFound):
            store.commit(keys)  # a later commit cannot resurrect the half-written chunks
        assert store.lookup(keys) == 0
        store.put_layer(2, layers[2])  # finishing the missing layer does
        store.commit(keys)
        assert store.lookup(keys) == 7


def test_bad_arguments_are_clear_value_errors(url):
    with pytest.raises(ValueError, match="unknown option"):
        open_store(url + "?nonsense=1")
    with open_test_store(url, LAYERS) as store:
        with pytest.raises(ValueError, match="out of range"):
            store.get_layer(LAYERS, [])
        with pytest.raises(ValueError, match="dtype"):
            store.put_layer(0, {"abc": torch.zeros(2, 1, 2, 8, dtype=torch.float16)})
        with pytest.raises(ValueError, match="shape"):
            store.put_layer(0, {"abc": torch.zeros(2, 1, 8, 2)})
    with open_store(url) as admin, pytest.raises(ValueError, match="fingerprint"):
        admin.lookup(["abc"])
