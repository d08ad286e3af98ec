"""A KV store that heals itself. On a real full disk (a 20 MiB tmpfs): saves evict before they write, a
failed save removes what it wrote and its later layers are swept without a later success, max_bytes counts
in-flight bytes, and `pd-kvstore stats` tells committed, in-flight and orphaned bytes apart. Through a real
P/D pair behind the proxy (file and redis): a chunk with a layer deleted makes the next decode recompute
exactly and is un-committed, the next prefill rewrites it and the request after that hits."""
from __future__ import annotations

import errno
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
import torch

from pdserve.deploy.processes import NODE_ARGS, ClusterSpec, LocalCluster, console_script
from pdserve.deploy.server_process import ServerProcess
from pdserve.kvstore import CorruptObject, StoreUnavailable, open_store
from pdserve.kvstore import fs_space
from tests.helpers.cluster import client, log_lines, wait_until
from tests.helpers.connector import LOAD_RE
from tests.helpers.kvstore import FP
from tests.helpers.oracles import hf_greedy
from tests.helpers.prompts import random_prompt
from tests.helpers.timing import HANG_S

KV_SHAPE = (8, 128)
TOKENS = 128  # one layer object: 2 x 128 x 8 x 128 fp32 = 1 MiB
LAYERS = 2
MiB = 2**20
MOUNTS = pytest.mark.root("mounts a 20 MiB tmpfs (a real full disk)")  # every test taking the `disk` fixture


@pytest.fixture()
def disk(tmp_path):
    """A real 20 MiB filesystem: writes past it fail with ENOSPC. Only root mounts one: its tests carry MOUNTS."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def _store(root: Path, **options):
    return open_store(f"file://{root}/kv", fingerprint=FP, num_layers=LAYERS, dtype=torch.float32,
                      kv_shape=KV_SHAPE, timeout=5.0, **options)


def _key(i: int) -> str:
    return f"chunk{i:06d}"


def _layer(i: int) -> torch.Tensor:
    return torch.full((2, TOKENS, *KV_SHAPE), float(i))


def _save(store, i: int) -> None:
    for layer in range(LAYERS):
        store.put_layer(layer, {_key(i): _layer(i)})
    store.commit([_key(i)])


def _ballast(path: Path, nbytes: int | None = None) -> None:
    """Another tenant's file: nbytes, or until the disk is full."""
    block = b"\0" * MiB
    with open(path, "wb") as f:
        written = 0
        while nbytes is None or written < nbytes:
            try:
                written += os.write(f.fileno(), block[:MiB if nbytes is None else min(MiB, nbytes - written)])
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                return


def _chunk_dirs(root: Path) -> dict[str, bool]:
    """{chunk key: committed} from the disk itself."""
    return {d.name: (d / "commit").exists() for d in (root / "kv" / FP).glob("*/*") if not d.name.startswith(".")}


@MOUNTS
def test_a_full_disk_costs_one_eviction_not_a_stream_of_failed_saves(disk):
    """max_bytes=16MiB on a 20 MiB disk that another tenant fills 6 MiB of: the bound alone would let saves
    fail with ENOSPC; each put evicts for the disk's real free space first, so every save succeeds."""
    _ballast(disk / "tenant", 6 * MiB)
    with _store(disk, max_bytes=16 * MiB) as store:
        for i in range(30):  # 60 MiB of saves through 14 MiB of room
            _save(store, i)
        on_disk = _chunk_dirs(disk)
        assert all(on_disk.values()) and on_disk  # nothing half-written left behind
        assert store.lookup([_key(29)]) == 1 and store.lookup([_key(0)]) == 0  # the newest kept, the oldest evicted
        usage = store.inventory()[FP]
        assert usage.committed_bytes == usage.bytes <= 16 * MiB
        assert usage.inflight_bytes == usage.orphaned_bytes == 0
        assert store.get_layer(1, [_key(29)])[0].eq(29).all()


@MOUNTS
@pytest.mark.slow  # seconds: outside make test-quick
def test_a_failed_save_removes_what_it_wrote_and_its_later_layers_are_swept(disk):
    with _store(disk, max_bytes=64 * MiB) as store:  # a bound larger than the disk: nothing to evict yet
        # (the default 2 s: the check that follows the later put below comes well within it, on any machine)
        store.sweep_after_s = fs_space.SWEEP_AFTER_S
        store.put_layer(0, {_key(1): _layer(1)})
        assert _chunk_dirs(disk) == {_key(1): False}
        _ballast(disk / "tenant")  # the disk fills up under the save
        with pytest.raises(StoreUnavailable, match="No space left"):
            store.put_layer(1, {_key(1): _layer(1)})
        assert _chunk_dirs(disk) == {}  # layer 0 removed at once
        (disk / "tenant").unlink()
        store.put_layer(1, {_key(1): _layer(1)})  # the failed save's later layer: a connector still puts it
        assert _chunk_dirs(disk) == {_key(1): False}
        # swept once quiet, with no later successful save to trigger it
        wait_until(lambda: _chunk_dirs(disk) == {}, "the failed save's later layer swept", HANG_S)
        assert store.lookup([_key(1)]) == 0
        _save(store, 2)  # the next save succeeds and nothing of the failed one is counted
        usage = store.inventory()[FP]
        assert (usage.chunks, usage.inflight_bytes, usage.orphaned_bytes) == (1, 0, 0)


@MOUNTS
def test_a_full_disk_during_a_save_evicts_room_for_the_next(disk):
    """The disk fills up under a save when the store holds committed chunks: the put evicts before it
    writes, and the save commits."""
    with _store(disk, max_bytes=64 * MiB) as store:
        for i in range(4):
            _save(store, i)
        store.put_layer(0, {_key(9): _layer(9)})
        _ballast(disk / "tenant")
        store.put_layer(1, {_key(9): _layer(9)})  # evicts the least recently used chunk(s) first
        store.commit([_key(9)])
        assert store.lookup([_key(9)]) == 1 and store.lookup([_key(0)]) == 0


def test_max_bytes_counts_chunks_in_flight(tmp_path):
    chunk = LAYERS * (MiB + 64)
    with _store(tmp_path, max_bytes=4 * chunk) as store:
        for i in range(3):
            _save(store, i)
        for layer in range(LAYERS):  # two chunks of one save in flight: 5 chunks' bytes would not fit
            store.put_layer(layer, {_key(10): _layer(10), _key(11): _layer(11)})
        on_disk = sum(p.stat().st_size for p in (tmp_path / "kv").rglob("*.kv"))
        assert on_disk <= store.max_bytes
        store.commit([_key(10), _key(11)])
        assert [store.lookup([_key(i)]) for i in (0, 1, 2, 10, 11)] == [0, 1, 1, 1, 1]  # one evicted


@pytest.mark.slow  # seconds: outside make test-quick
def test_stats_separates_committed_in_flight_and_orphaned_bytes(tmp_path):
    with _store(tmp_path) as store:
        _save(store, 1)
        store.put_layer(0, {_key(2): _layer(2)})  # in flight
        store.put_layer(0, {_key(3): _layer(3)})  # left by a writer that died long ago
        dead = next((tmp_path / "kv" / FP).glob(f"*/{_key(3)}"))
        old = time.time() - 3600
        os.utime(dead, (old, old))
        done = subprocess.run([sys.executable, "-m", "pdserve.kvstore.cli", f"file://{tmp_path}/kv", "stats", "--json"],
                              capture_output=True, text=True, timeout=60, check=True)
        usage = json.loads(done.stdout)[FP]
        obj = MiB + 64
        assert (usage["chunks"], usage["committed_bytes"], usage["inflight_chunks"], usage["inflight_bytes"],
                usage["orphaned_chunks"], usage["orphaned_bytes"]) == (1, 2 * obj, 1, obj, 1, obj)
        text = subprocess.run([sys.executable, "-m", "pdserve.kvstore.cli", f"file://{tmp_path}/kv", "stats"],
                              capture_output=True, text=True, timeout=60, check=True).stdout
        assert f"{2 * obj} committed, {obj} in flight (1 chunk(s)), {obj} orphaned (1 chunk(s))" in text


@MOUNTS
def test_the_default_store_is_bounded_by_the_smaller_of_20_gib_and_10_percent_of_its_filesystem(disk, tmp_path):
    with _store(disk) as store:
        assert store.max_bytes == 2 * MiB  # 10% of 20 MiB
        assert "bounded at" in store.bounds_note() and "default" in store.bounds_note()
        assert store.bounds_warning() is None
    st = os.statvfs(tmp_path)
    with _store(tmp_path) as store:
        assert store.max_bytes == min(20 * 2**30, int(st.f_blocks * st.f_frsize * 0.10))
        assert store.max_bytes == fs_space.default_max_bytes(str(tmp_path / "kv"))
    with _store(tmp_path, max_bytes=0) as store:
        assert store.max_bytes is None and "unbounded" in store.bounds_warning()


def _prefill_args(tiny_llama, store: Path, *args: str) -> list[str]:
    return ["--model", str(tiny_llama), "--dtype", "float32", "--port", "0", "--grpc-port", "0", "--kv-cache-memory",
            "16MiB", "--max-model-len", "2048", "--shutdown-timeout", "1", "--kv-store", store.as_uri(), *args]


@MOUNTS
@pytest.mark.slow  # seconds: outside make test-quick
def test_a_default_bound_too_small_for_the_nodes_chunks_is_refused_or_named(disk, tiny_llama):
    """On a real 20 MiB filesystem the default bound is 2 MiB. A node whose chunks take more (tiny llama, fp32,
    2048-token chunks: 4 x 1 MiB) refuses to start, saying what to set; one whose chunks fit but not 4 prompts'
    (256-token chunks, 512 KiB: 3 of them, prompts up to 2048 tokens) starts and warns, naming ?max_bytes=."""
    done = subprocess.run([*console_script("pd-prefill"), *_prefill_args(tiny_llama, disk / "kv", "--chunk-size", "2048")],
                          capture_output=True,
                          text=True, timeout=HANG_S, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lines = [line for line in done.stderr.strip().splitlines() if " INFO " not in line]  # the log's lines go
    assert done.returncode == 1 and len(lines) == 1 and lines[0].startswith("pd-prefill: error: "), lines
    assert "Traceback" not in done.stderr
    assert f"KV store {disk / 'kv'}: 2097152 bytes (the default bound: 10% of its 20971520-byte filesystem) " \
           "cannot hold one chunk of 2048 tokens (4194560 bytes)" in lines[0], lines
    assert "set ?max_bytes= in the store URL to at least 16778240 (or 0: no bound)" in lines[0], lines
    with ServerProcess(*_prefill_args(tiny_llama, disk / "kv", "--chunk-size", "256"),
                       exe=console_script("pd-prefill")) as node:
        warning = [line for line in node.log.splitlines() if "fewer than 4 prompts" in line]
        assert len(warning) == 1 and "WARNING" in warning[0], node.log
        assert "2097152 bytes (the default bound: 10% of its 20971520-byte filesystem) hold 3 chunk(s) of 256 " \
               "tokens, fewer than 4 prompts of 2048 tokens" in warning[0]
        assert "set ?max_bytes= in the store URL to at least 16785408 (or 0: no bound)" in warning[0]


# ---- damaged chunks heal through a real P/D pair behind the proxy ----

PD_PROMPT = random_prompt(300, seed=830)  # 5 chunks of 64 tokens
PD_MAX_TOKENS = 8


def _damage_one_chunk(store: str, kv_store: str, root: Path, damage: str) -> str:
    """Delete layer 1 of one committed chunk of the store (damage "layer"), or make its marker's layer count
    4294967298 (damage "marker": byte 9 of a file marker flipped); returns that chunk's key."""
    if store == "file":
        victim = sorted(root.rglob("commit"))[2].parent
        if damage == "layer":
            (victim / "1.kv").unlink()
        else:
            raw = bytearray((victim / "commit").read_bytes())
            raw[9] ^= 0xFF
            (victim / "commit").write_bytes(bytes(raw))
        return victim.name
    client = redis.Redis.from_url(kv_store)
    name = sorted(k for k in client.scan_iter(match="pdkv:*:1") if client.exists(k[:-1] + b"c"))[2]
    if damage == "layer":
        client.delete(name)
    else:
        client.set(name[:-1] + b"c", str(int(client.get(name[:-1] + b"c")) + (0xFF << 24)))
    return name.decode().split("{")[1].split("}")[0]


def _committed(store: str, kv_store: str, root: Path, key: str) -> bool:
    if store == "file":
        return any(root.rglob(f"{key}/commit"))
    return bool(list(redis.Redis.from_url(kv_store).scan_iter(match=f"pdkv:*:{{{key}}}:c")))


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["layer", "marker"])
@pytest.mark.parametrize("store", ["file", "redis"])
def test_a_damaged_chunk_is_healed_by_the_next_prefill(store, damage, tiny_llama, tmp_path):
    ref = hf_greedy(tiny_llama, [PD_PROMPT], PD_MAX_TOKENS)[0]
    root = tmp_path / "kv"
    # three decode nodes taken in turn: each request meets a cold decode (no local prefix cache to hide the store)
    cluster = LocalCluster(ClusterSpec(model=str(tiny_llama), log_dir=tmp_path / "logs", store=store,
                                       kv_store=root.as_uri() if store == "file" else None, num_decode=3,
                                       policy="round-robin", node_args=list(NODE_ARGS),
                                       proxy_args=["--health-interval", "0.3"]))
    cluster.start(timeout_s=180)
    try:
        cl = client(cluster.url)
        model = cl.models.list().data[0].id

        def complete(rid: str) -> list[int]:
            resp = cl.completions.create(model=model, prompt=PD_PROMPT, max_tokens=PD_MAX_TOKENS, temperature=0,
                                         extra_body={"return_token_ids": True}, extra_headers={"X-Request-Id": rid})
            return resp.choices[0].token_ids

        def decode_lines(rid: str) -> list[str]:
            return [line for node in cluster.decode for line in log_lines(node.log_file, rid)]

        def loaded(rid: str) -> int:
            """Prompt tokens the decode node loaded from the store (its KV load line)."""
            return sum(int(m[2]) for line in decode_lines(rid) if (m := LOAD_RE.search(line)))

        # saved, then loaded (all of it: decode goes on from the first token)
        assert complete(f"heal-{store}-1") == ref and loaded(f"heal-{store}-1") == len(PD_PROMPT)
        key = _damage_one_chunk(store, cluster.kv_store, root, damage)
        assert complete(f"heal-{store}-2") == ref  # the decode's load fails: it recomputes, exactly
        assert any("KV load failed" in line for line in decode_lines(f"heal-{store}-2"))
        wait_until(lambda: not _committed(store, cluster.kv_store, root, key), "the damaged chunk un-committed",
                   HANG_S)
        # the prefill rewrote it: a whole load again
        assert complete(f"heal-{store}-3") == ref and loaded(f"heal-{store}-3") == len(PD_PROMPT)
        assert _committed(store, cluster.kv_store, root, key)
        assert not any("KV load failed" in line for line in decode_lines(f"heal-{store}-3"))
    finally:
        cluster.stop()


# ---- pd-kvstore verify reports every kind of damage and --repair un-commits it ----

def _four_chunks(url: str) -> None:
    with open_store(url, fingerprint=FP, num_layers=LAYERS, dtype=torch.float32, kv_shape=(2, 8)) as store:
        for i in range(4):
            for layer in range(LAYERS):
                store.put_layer(layer, {_key(i): torch.full((2, 16, 2, 8), float(i))})
            store.commit([_key(i)])


def _verify(url: str, *args: str) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-m", "pdserve.kvstore.cli", url, "verify", *args], capture_output=True,
                          text=True, timeout=60)
    return done.returncode, done.stdout


def _lookups(url: str) -> list[int]:
    with open_store(url, fingerprint=FP, num_layers=LAYERS, dtype=torch.float32, kv_shape=(2, 8)) as store:
        return [store.lookup([_key(i)]) for i in range(4)]


@pytest.mark.slow  # seconds: outside make test-quick
def test_verify_reports_and_repairs_each_kind_of_damage_in_a_file_store(tmp_path):
    url = f"file://{tmp_path}"
    _four_chunks(url)
    chunk = {i: next(tmp_path.glob(f"{FP}/*/{_key(i)}")) for i in range(4)}
    (chunk[0] / "1.kv").unlink()  # a missing layer
    (chunk[1] / "commit").write_bytes(b"")  # an empty marker
    (chunk[2] / "commit").write_bytes(b"PDKX" + b"\0" * 14)  # a corrupted marker
    raw = bytearray((chunk[3] / "0.kv").read_bytes())
    raw[-1] ^= 0xFF
    (chunk[3] / "0.kv").write_bytes(bytes(raw))  # a corrupted object
    code, out = _verify(url)
    assert code == 1
    assert f"DAMAGED {FP}/{_key(0)}: layer 1 of 2 missing" in out
    assert f"DAMAGED {FP}/{_key(1)}: empty commit marker" in out
    assert f"DAMAGED {FP}/{_key(2)}: corrupted commit marker" in out
    assert f"CORRUPT {chunk[3]}/0.kv: checksum mismatch" in out
    assert "1 corrupt, 3 damaged chunk(s)" in out
    assert _lookups(url) == [1, 1, 1, 1]  # verify alone changes nothing
    code, out = _verify(url, "--repair")
    assert code == 0 and "un-committed 4 chunk(s)" in out
    assert _lookups(url) == [0, 0, 0, 0]
    _four_chunks(url)  # the next prefill rewrites them
    code, out = _verify(url)
    assert code == 0 and "0 corrupt, 0 damaged chunk(s)" in out
    assert _lookups(url) == [1, 1, 1, 1]


VERIFY_DATA_BYTES = 4 * 2**30  # the verify process's heap: ~10x what it needs, far from a 4e9-name list


def _verify_in_bounded_memory(url: str, *args: str) -> tuple[int, str, str]:
    """pd-kvstore verify with its data segment limited (RLIMIT_DATA): a marker trusted for a list of its
    layers fails at once with MemoryError instead of growing past the machine's memory."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_DATA, (VERIFY_DATA_BYTES, VERIFY_DATA_BYTES))
    done = subprocess.run([sys.executable, "-m", "pdserve.kvstore.cli", url, "verify", *args], capture_output=True,
                          text=True, timeout=60, preexec_fn=limit)
    return done.returncode, done.stdout, done.stderr


@pytest.mark.slow  # seconds: outside make test-quick
@pytest.mark.parametrize("kind", ["file", "redis"])
def test_a_marker_with_a_damaged_layer_count_is_damage_never_an_allocation(kind, tmp_path, request):
    """Byte 9 of a file marker flipped (its layer count becomes 4294967298), or a redis marker saying so: the
    chunk is no hit a load trusts, verify reports it without sizing anything by it, repair un-commits it. A
    layer count that stays small (253: byte 6 flipped) is damage too: the model has 2 layers."""
    url = f"file://{tmp_path}" if kind == "file" else request.getfixturevalue("redis_server").url
    _four_chunks(url)
    if kind == "file":
        for i, byte in ((0, 9), (1, 6)):
            marker = next(tmp_path.glob(f"{FP}/*/{_key(i)}")) / "commit"
            raw = bytearray(marker.read_bytes())
            raw[byte] ^= 0xFF
            marker.write_bytes(bytes(raw))
    else:
        client = redis.Redis.from_url(url)
        client.set(f"pdkv:{FP}:{{{_key(0)}}}:c", b"4294967298")
        client.set(f"pdkv:{FP}:{{{_key(1)}}}:c", b"253")
    code, out, err = _verify_in_bounded_memory(url)
    assert (code, err) == (1, "")
    assert f"DAMAGED {FP}/{_key(0)}: corrupted commit marker" in out
    assert f"DAMAGED {FP}/{_key(1)}: layer 2 of 253 missing" in out
    assert "0 corrupt, 2 damaged chunk(s)" in out
    with open_store(url, fingerprint=FP, num_layers=LAYERS, dtype=torch.float32, kv_shape=(2, 8)) as store:
        assert store.lookup([_key(0), _key(1), _key(2)]) == 3  # present: the load that follows finds the damage
        with pytest.raises(CorruptObject, match="corrupted commit marker"):
            store.layouts([_key(0)])
        with pytest.raises(CorruptObject, match="commit marker records 253 layers, the model has 2"):
            store.layouts([_key(1)])
        assert store.layouts([_key(2)])[0].num_layers == LAYERS
    with open_store(url, fingerprint=FP, num_layers=LAYERS, dtype=torch.float32, kv_shape=(2, 8)) as store:
        assert store.repair([_key(0), _key(1), _key(2)]) == 2  # what a failed load calls
    assert _lookups(url) == [0, 0, 1, 1]
    _four_chunks(url)  # the next prefill rewrites them
    code, out, _ = _verify_in_bounded_memory(url)
    assert code == 0 and "0 corrupt, 0 damaged chunk(s)" in out
    assert _lookups(url) == [1, 1, 1, 1]


@pytest.mark.slow  # seconds: outside make test-quick
def test_verify_reports_and_repairs_damage_in_redis(redis_server):
    url = redis_server.url
    _four_chunks(url)
    client = redis.Redis.from_url(url)
    client.delete(f"pdkv:{FP}:{{{_key(0)}}}:1")  # a missing layer (evicted under its marker)
    client.set(f"pdkv:{FP}:{{{_key(1)}}}:c", b"")  # an empty marker
    client.set(f"pdkv:{FP}:{{{_key(2)}}}:c", b"x2")  # a corrupted marker
    code, out = _verify(url)
    assert code == 1 and "0 corrupt, 3 damaged chunk(s)" in out
    assert f"DAMAGED {FP}/{_key(0)}: layer 1 of 2 missing" in out
    assert f"DAMAGED {FP}/{_key(1)}: empty commit marker" in out
    assert f"DAMAGED {FP}/{_key(2)}: corrupted commit marker" in out
    code, out = _verify(url, "--repair")
    assert code == 0 and "un-committed 3 chunk(s)" in out
    assert _lookups(url) == [0, 0, 0, 1]
    assert not list(client.scan_iter(match=f"pdkv:{FP}:{{{_key(0)}}}:*"))  # its other layer went too
