"""file:// specifics: damage on disk, atomic layout, the max_bytes bound with LRU eviction."""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from pdserve.kvstore import CorruptObject, NotFound, StoreUnavailable, object_format, open_store
from pdserve.kvstore.filesystem import FileSystemStore
from tests.helpers.kvstore import FP, OTHER_FP, make_chunks, open_test_store, spawn_writer, start, write_all


def _object_path(root: Path, key: str, layer: int, fingerprint: str = FP) -> Path:
    return root / fingerprint / key[:2] / key / f"{layer}.kv"


def _kv_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*.kv"))


def test_damaged_files_are_corrupt_and_verify_names_them(tmp_path):
    keys, layers = make_chunks(48, 2)
    store = open_test_store(f"file://{tmp_path}", 2)
    write_all(store, keys, layers)
    flipped = _object_path(tmp_path, keys[0], 1)
    raw = bytearray(flipped.read_bytes())
    raw[len(raw) // 2] ^= 1
    flipped.write_bytes(raw)
    truncated = _object_path(tmp_path, keys[1], 0)
    truncated.write_bytes(truncated.read_bytes()[:-100])
    with pytest.raises(CorruptObject, match="checksum"):
        store.get_layer(1, keys[:1])
    with pytest.raises(CorruptObject, match="header says"):
        store.get_layer(0, keys[1:2])
    staging = torch.empty(2, 16, *layers[0][keys[0]].shape[2:])  # the decode hot path checks the same
    with pytest.raises(CorruptObject, match="checksum"):
        store.get_layer_into(1, keys[:1], staging, [16])
    with pytest.raises(CorruptObject, match="bytes, expected"):
        store.get_layer_into(0, keys[1:2], staging, [16])
    assert len(store.get_layer(0, [keys[0], keys[2]])) == 2  # undamaged objects still read
    report = store.verify()
    assert report.objects == 6 and len(report.corrupt) == 2
    assert str(flipped) in " ".join(report.corrupt) and str(truncated) in " ".join(report.corrupt)


def test_object_of_another_model_under_our_name_is_corrupt(tmp_path):
    keys, layers = make_chunks(16, 1)
    write_all(open_test_store(f"file://{tmp_path}", 1, fingerprint=OTHER_FP), keys, layers)
    mine = _object_path(tmp_path, keys[0], 0)
    mine.parent.mkdir(parents=True)
    os.link(_object_path(tmp_path, keys[0], 0, OTHER_FP), mine)
    (mine.parent / "commit").write_bytes(b"")
    store = open_test_store(f"file://{tmp_path}", 1)
    assert store.lookup(keys) == 1
    with pytest.raises(CorruptObject, match="written for model"):
        store.get_layer(0, keys)


def test_valid_object_under_another_key_or_layer_is_corrupt_and_verify_reports_it(tmp_path):
    keys, layers = make_chunks(48, 2)  # three full chunks: every object has the same shape and size
    store = open_test_store(f"file://{tmp_path}", 2)
    write_all(store, keys, layers)
    misplaced = _object_path(tmp_path, keys[2], 1)
    shutil.copy(_object_path(tmp_path, keys[0], 1), misplaced)  # another chunk's layer 1
    swapped = _object_path(tmp_path, keys[1], 0)
    shutil.copy(_object_path(tmp_path, keys[1], 1), swapped)  # the same chunk's other layer
    with pytest.raises(CorruptObject, match="another chunk or layer"):
        store.get_layer(1, keys)
    with pytest.raises(CorruptObject, match="another chunk or layer"):
        store.get_layer(0, keys[1:2], out=[torch.empty_like(layers[0][keys[1]])])
    assert len(store.get_layer(1, keys[:2])) == 2  # the objects left in place still read
    report = store.verify()
    reason = "a valid object of another chunk or layer, stored under the wrong key"
    assert report.objects == 6 and sorted(report.corrupt) == sorted(f"{p}: {reason}" for p in (misplaced, swapped))


def test_layout_has_no_temp_files_and_missing_objects_are_not_found(tmp_path):
    keys, layers = make_chunks(40, 2, torch.bfloat16)
    store = open_test_store(f"file://{tmp_path}", 2, torch.bfloat16)
    write_all(store, keys, layers)
    names = sorted(p.name for p in (tmp_path / FP / keys[0][:2] / keys[0]).iterdir())
    assert names == ["0.kv", "1.kv", "commit"]
    ledger = {".ledger", ".ledger.lock", ".ledger.walked"}  # the default bound's (kvstore/fs_ledger.py)
    assert not [p for p in tmp_path.rglob(".*") if p.name not in ledger]
    _object_path(tmp_path, keys[2], 1).unlink()
    with pytest.raises(NotFound):
        store.get_layer(1, keys)
    assert store.clear() == 5 and store.lookup(keys) == 0
    assert {p.name for p in tmp_path.iterdir()} <= ledger


def test_max_bytes_bound_holds_and_evicts_least_recently_used(tmp_path):
    keys, layers = make_chunks(16 * 40, 2)  # 40 full chunks, 2 layers each
    chunk_bytes = 2 * (64 + layers[0][keys[0]].numel() * 4)
    url = f"file://{tmp_path}?max_bytes={10 * chunk_bytes + chunk_bytes // 2}"
    writer = open_test_store(url, 2)
    reader = open_test_store(url, 2)  # a second store object: the LRU clock lives on disk, not in memory
    hot, cold = keys[0], keys[1]
    for n, key in enumerate(keys):
        for i in range(2):
            writer.put_layer(i, {key: layers[i][key]})
        writer.commit([key])
        assert _kv_bytes(tmp_path) <= writer.max_bytes
        if n >= 1:
            assert torch.equal(reader.get_layer(0, [hot])[0], layers[0][hot])  # keeps `hot` recently used
    committed = [k for k in keys if writer.lookup([k])]
    assert len(committed) == 10
    assert hot in committed and cold not in committed
    assert committed[1:] == keys[-9:]  # everything else: the newest chunks survive
    assert writer.inventory()[FP].bytes == 10 * chunk_bytes


def test_unusable_root_is_unavailable(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(StoreUnavailable):
        open_store(f"file://{blocker}/store")
    with pytest.raises(ValueError, match="file:///"):
        open_store("file://relative/path")


def test_deleted_store_directory_is_an_outage_not_a_miss(tmp_path):
    keys, layers = make_chunks(48, 2)
    root = tmp_path / "store"
    store = open_test_store(f"file://{root}", 2)
    write_all(store, keys, layers)
    assert store.lookup(keys) == len(keys)
    shutil.rmtree(root)
    with pytest.raises(StoreUnavailable, match="gone"):
        store.lookup(keys)
    write_all(store, keys, layers)  # a producer's next save recreates the tree
    assert store.lookup(keys) == len(keys)


def _committed_bytes(root: Path) -> int:
    """Bytes of the layer objects of committed chunks, from the disk itself."""
    return sum(p.stat().st_size for marker in root.rglob("commit") for p in marker.parent.glob("*.kv"))


def test_eviction_replays_a_ledger_instead_of_walking_the_tree(tmp_path):
    keys, layers = make_chunks(16 * 300, 1)  # 300 chunks
    chunk_bytes = 64 + layers[0][keys[0]].nbytes
    filler = open_test_store(f"file://{tmp_path}?max_bytes=1GiB", 1)
    for i in range(0, 250, 50):  # 250 chunks in, nothing to evict yet
        filler.put_layer(0, {k: layers[0][k] for k in keys[i:i + 50]})
        filler.commit(keys[i:i + 50])
    assert filler._space.ledger.disk_scans == 1  # the ledger's birth: one walk of an empty tree
    bounded = open_test_store(f"file://{tmp_path}?max_bytes={200 * chunk_bytes}", 1)  # a second process's view
    hot = keys[0]
    for key in keys[250:]:
        bounded.get_layer(0, [hot])  # a reader keeps the oldest chunk recently used
        bounded.put_layer(0, {key: layers[0][key]})
        bounded.commit([key])
        assert _committed_bytes(tmp_path) <= bounded.max_bytes
    assert bounded._space.ledger.disk_scans == 0  # 50 commits and 100 evictions, not one walk of the tree
    present = [k for k in keys if bounded.lookup([k])]
    assert present == [hot, *keys[-199:]]  # exact LRU: the read chunk survived, the oldest others went
    assert bounded._space.ledger.total == _committed_bytes(tmp_path) == 200 * chunk_bytes
    with filler._space.ledger.locked() as ledger:  # the first process catches up from the ledger too
        assert ledger.total == bounded._space.ledger.total and set(ledger.sizes) == {f"{FP}/{k}" for k in present}


def test_ledger_operations_stay_cheap_at_100k_chunks(tmp_path):
    from pdserve.kvstore.fs_ledger import ChunkLedger

    def ledger() -> ChunkLedger:
        return ChunkLedger(str(tmp_path), walk=lambda: iter(()), size_of=lambda rel: None)

    with ledger().locked() as first:
        first.add([(f"{FP}/{i:032x}", 1000, i) for i in range(100_000)])
    other = ledger()
    started = time.perf_counter()
    with other.locked() as view:  # another process replays 100k lines once...
        assert view.total == 100_000_000 and len(view.sizes) == 100_000
    replay_s = time.perf_counter() - started
    started = time.perf_counter()
    for i in range(2000):  # ...then each commit costs one append and one eviction
        with other.locked() as view:
            view.add([(f"{FP}/{100_000 + i:032x}", 1000, 100_000 + i)])
            clock, rel = view.oldest()
            assert clock == i
            view.remove([rel])
    commits_s = time.perf_counter() - started
    # Against the replay, timed here on this machine: the 2000 commits cost a fraction of one replay; a
    # replay (or a walk) per commit would cost 2000 of them.
    assert commits_s < 50 * replay_s, f"2000 commits took {commits_s:.2f} s, one replay {replay_s:.3f} s"
    assert other.disk_scans == 0 and other.total == 100_000_000


@pytest.mark.slow  # seconds: outside make test-quick
def test_bound_holds_with_writer_processes_sharing_the_directory(tmp_path):
    keys, layers = make_chunks(100, 2)
    chunk_bytes = 2 * (64 + layers[0][keys[0]].nbytes)
    url = f"file://{tmp_path}?max_bytes={10 * chunk_bytes}"
    writers = [spawn_writer(url, 2, rounds=1, seed=seed, tokens=16 * 12) for seed in (1, 2)]  # 24 chunks
    start(writers)
    assert [w.wait() for w in writers] == [0, 0]
    assert _committed_bytes(tmp_path) <= 10 * chunk_bytes
    with open_test_store(url, 2) as store:
        with store._space.ledger.locked() as ledger:
            assert ledger.total == _committed_bytes(tmp_path) == 10 * chunk_bytes  # evicted down to the bound
        present = [k for seed in (1, 2) for k in make_chunks(16 * 12, 2, seed=seed)[0] if store.lookup([k])]
        assert len(present) == 10 and store.verify().corrupt == []
        for i in range(2):
            assert len(store.get_layer(i, present)) == 10  # whole chunks only


def test_reconcile_counts_chunks_of_unbounded_stores_and_removes_dead_writers_leftovers(tmp_path):
    keys, layers = make_chunks(16 * 6, 1)
    chunk_bytes = 64 + layers[0][keys[0]].nbytes
    bounded = open_test_store(f"file://{tmp_path}?max_bytes={4 * chunk_bytes}", 1)
    write_all(bounded, keys[:2], [{k: layers[0][k] for k in keys[:2]}])
    unbounded = open_test_store(f"file://{tmp_path}?max_bytes=0", 1)  # misconfigured peer: no ledger lines
    write_all(unbounded, keys[2:], [{k: layers[0][k] for k in keys[2:]}])
    orphan = tmp_path / FP / "zz" / "zzzz-dead-writer"
    orphan.mkdir(parents=True)
    (orphan / "0.kv").write_bytes(b"x" * 10)
    old = time.time() - 3600
    os.utime(orphan, (old, old))
    assert bounded.reconcile() == (4, 0)
    assert not orphan.exists()
    assert _committed_bytes(tmp_path) == bounded._space.ledger.total == 4 * chunk_bytes  # evicted down to the bound
    assert [bool(bounded.lookup([k])) for k in keys] == [False, False, True, True, True, True]


@pytest.mark.parametrize("idle_s, kept", [(1, 4), (60, 3)])
def test_max_bytes_counts_another_writers_uncommitted_chunk_only_once_it_is_stale(tmp_path, idle_s, kept):
    """A live writer's save in progress is that writer's to count (counting it here too evicted twice
    over); a chunk left uncommitted for longer than any save takes holds disk until the grace removes it."""
    keys, layers = make_chunks(16 * 4, 1)
    chunk_bytes = 64 + layers[0][keys[0]].nbytes
    store = open_test_store(f"file://{tmp_path}?max_bytes={4 * chunk_bytes}", 1)
    write_all(store, keys, [{k: layers[0][k] for k in keys}])
    other = tmp_path / FP / "zz" / "zzzz-other-writer"
    other.mkdir(parents=True)
    (other / "0.kv").write_bytes(b"x" * chunk_bytes)
    then = time.time() - idle_s
    os.utime(other, (then, then))
    store.reconcile()
    assert [bool(store.lookup([k])) for k in keys].count(True) == kept
    assert other.exists()
    store.close()


def test_layer_objects_name_and_expect_what_the_codec_says(tmp_path):
    """The compiled reader's paths and expected headers, kept per chunk across a load's layers, are
    object_name's and object_format.expected_header's for every layer, chunk size and fingerprint."""
    store = FileSystemStore(tmp_path, fingerprint="ab" * 16, num_layers=3)
    keys = ["k" * 8 + str(i) for i in range(3)]
    for fingerprint in ("ab" * 16, "cd" * 16):
        store._model.fingerprint = fingerprint  # noqa: SLF001 (the binding its reads share)
        for layer in range(3):
            for dtype, n in ((torch.bfloat16, 16), (torch.float32, 5)):
                items, shapes = [(layer, key) for key in keys], [(2, n, 2, 4)] * len(keys)
                paths, expect = store._files.layer_objects(items, shapes, dtype)
                assert paths == [store.object_name(key, layer) for key in keys]
                assert expect == b"".join(object_format.expected_header(fingerprint, dtype, shape, key=key, layer=layer)
                                          for (_, key), shape in zip(items, shapes))
    store.close()


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_a_store_reads_in_c_unless_torch_kernels_are_asked_for(tmp_path, monkeypatch, kernels):
    """A store takes the process's compiled reader at its first load into spans (kvstore/native_reader.py:
    nobody hands it one); under PDSERVE_KERNELS=torch it reads in Python. Either way the chunks land
    whole and checked."""
    import numpy as np

    from pdserve.kvstore.gate import WriteGate
    from pdserve.kvstore.native_reader import KVReadLibrary
    from pdserve.kvstore.spans import SpanTable

    monkeypatch.setenv("PDSERVE_KERNELS", kernels)
    store = open_test_store(f"file://{tmp_path}", 2)
    keys, layers = make_chunks(40, 2)
    write_all(store, keys, layers)
    lens = [layers[0][key].shape[1] for key in keys]
    for layer in range(2):
        staging = torch.zeros(2, sum(lens), *layers[0][keys[0]].shape[2:])
        flat = memoryview(staging.view(torch.uint8).numpy()).cast("B")
        half, row, rows, first = flat.nbytes // 2, flat.nbytes // (2 * sum(lens)), [], [0]
        for start, n in zip(np.cumsum([0, *lens[:-1]]).tolist(), lens):
            rows += [(0, start * row, n * row), (0, half + start * row, n * row)]
            first.append(len(rows))
        table = SpanTable([flat], np.array(rows, np.int64), np.array(first, np.int64))
        store.get_layer_spans(layer, keys, table, lens, WriteGate())
        assert torch.equal(staging, torch.cat([layers[layer][key] for key in keys], dim=1))
    if kernels == "torch":
        assert store.span_reader is None
    else:
        assert isinstance(store.span_reader, KVReadLibrary)
    store.close()
