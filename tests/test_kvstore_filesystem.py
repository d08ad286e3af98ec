"""file:// specifics: damage on disk, atomic layout, the max_bytes bound with LRU eviction."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from kvstore import CorruptObject, NotFound, StoreUnavailable, open_store
from tests.kvstore_helpers import FP, OTHER_FP, make_chunks, open_test_store, write_all


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


def test_layout_has_no_temp_files_and_missing_objects_are_not_found(tmp_path):
    keys, layers = make_chunks(40, 2, torch.bfloat16)
    store = open_test_store(f"file://{tmp_path}", 2, torch.bfloat16)
    write_all(store, keys, layers)
    names = sorted(p.name for p in (tmp_path / FP / keys[0][:2] / keys[0]).iterdir())
    assert names == ["0.kv", "1.kv", "commit"]
    assert not [p for p in tmp_path.rglob(".*")]
    _object_path(tmp_path, keys[2], 1).unlink()
    with pytest.raises(NotFound):
        store.get_layer(1, keys)
    assert store.clear() == 5 and store.lookup(keys) == 0 and not list(tmp_path.iterdir())


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
