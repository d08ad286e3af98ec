"""Loads read straight into paged KV blocks, and a read that returns after its load was abandoned writes nothing.

The invariant (docs/architecture.md, Invariants): bytes reach a load's blocks only inside its write
gate (kvstore.gate); a failed or cancelled load closes the gate, after which no read it started
writes anything there, however late it returns. The end-to-end test makes a real file store's
read of one object hang (as on a hung NFS mount: no RWF_NOWAIT there, every read waits for the
medium), lets the load time out and the request recompute, hands the blocks over (a sentinel fill
of the whole cache stands for "recomputed, or another request's now"), then lets the read finish.
"""
from __future__ import annotations

import os
import random
import threading

import numpy as np
import pytest
import torch

from pdserve.connectors.chunk_math import LoadPlan, chunk_bounds, slots_for
from pdserve.connectors.direct_rows import DirectRows, cache_bytes
from pdserve.kvstore.native_reader import KVReadLibrary
from pdserve.kvstore import CorruptObject, NotFound, open_store
from pdserve.kvstore.filesystem import FileSystemStore
from pdserve.kvstore.gate import LoadAbandoned, WriteGate
from pdserve.kvstore.spans import SpanTable
from tests.helpers.connector import FALLBACK_RE, GREEDY, PREFILL, capture, engine_pair, lines, mono_engine, prompt
from tests.helpers.kvstore import CHUNK, KV_SHAPE, make_chunks, open_test_store, write_all

pytestmark = pytest.mark.timeout(120)
SENTINEL = 0x5A


# ---- where each byte goes ----
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("seed", range(40))
def test_direct_rows_put_exactly_the_write_range_in_its_slots(seed, compiled, compiled_reader):
    """Every chunk's payload through DirectRows' spans == the write range's rows scattered into their slots
    (rows before N and after the last loaded token land in scratch, never in the cache), planned in numpy
    or in C (kv_read.c, pd_rows_plan)."""
    rng = random.Random(seed)
    block, heads, dim, num_blocks = 4, 2, 4, 48
    chunk = block * rng.choice([1, 2, 4])
    tokens = rng.randrange(2, 70)
    local = block * rng.randrange(0, (tokens - 1) // block + 1)
    plan = LoadPlan(tokens, local, min(tokens, chunk * rng.randrange(1, tokens // chunk + 2)), chunk)
    if not plan.need_to_load:
        return
    lo, hi = plan.write_range
    blocks = rng.sample(range(num_blocks), -(-tokens // block))
    if seed % 2:
        blocks.sort()  # consecutive blocks: runs merge across block boundaries
    slots = slots_for(blocks, lo, hi, block)
    bounds = [chunk_bounds(i, tokens, chunk) for i in plan.chunk_range]
    first = plan.aligned_start
    cache = torch.zeros(2, num_blocks, block, heads, dim)
    row = heads * dim * cache.element_size()
    rows = DirectRows.plan(slots, [b - a for a, b in bounds], lo - first, hi - first, row, cache[0].numel() * 4,
                           compiled_reader if compiled else None)
    assert rows.scratch_bytes == 2 * row * (bounds[-1][1] - first - (hi - lo))  # exactly the rows not written
    for j in range(len(bounds)):  # each half's pieces are maximal: a piece ends where the next is elsewhere
        pieces = rows.desc[rows.first[j]:rows.first[j + 1]].tolist()
        k, v = pieces[:len(pieces) // 2], pieces[len(pieces) // 2:]
        assert len(k) == len(v) and [p[2] for p in k] == [p[2] for p in v]
        for half in (k, v):
            assert all((a[0], a[1] + a[2]) != (b[0], b[1]) for a, b in zip(half, half[1:]))
    scratch = memoryview(bytearray(rows.scratch_bytes + 1))
    spans = rows.spans(cache_bytes(cache), scratch).views()
    kv = torch.randn(2, bounds[-1][1] - first, heads, dim)
    for (a, b), chunk_spans in zip(bounds, spans):
        payload = kv[:, a - first:b - first].contiguous().view(torch.uint8).numpy().tobytes()
        assert sum(span.nbytes for span in chunk_spans) == len(payload)
        offset = 0
        for span in chunk_spans:
            span[:] = payload[offset:offset + span.nbytes]
            offset += span.nbytes
    want = torch.zeros_like(cache)
    want.view(2, -1, heads, dim)[:, slots] = kv[:, lo - first:hi - first]
    assert torch.equal(cache, want)


def test_the_compiled_plan_makes_the_pieces_of_the_numpy_plan(compiled_reader):
    """pd_rows_plan and DirectRows' numpy plan agree piece for piece on any rows [lo, hi) of any chunks
    (scattered slots, runs of consecutive ones, nothing to write), and bad arguments are refused."""
    rng = random.Random(5)
    for _ in range(500):
        lens = [rng.randrange(1, 40) for _ in range(rng.randrange(1, 6))]
        total = sum(lens)
        lo = rng.randrange(0, total)
        hi = rng.randrange(lo, total + 1)
        kind = rng.randrange(3)
        picked = rng.sample(range(10 * total), hi - lo) if kind == 0 else sorted(rng.sample(range(3 * total), hi - lo))
        slots = torch.tensor(picked if kind < 2 else range(7, 7 + hi - lo), dtype=torch.int64)
        args = (slots, lens, lo, hi, 8, 10 ** 6)
        fast, slow = DirectRows.plan(*args, compiled=compiled_reader), DirectRows.plan(*args)
        assert fast.desc.tolist() == slow.desc.tolist() and fast.first.tolist() == slow.first.tolist()
        assert fast.scratch_bytes == slow.scratch_bytes
    with pytest.raises(ValueError, match="int64 slots"):
        compiled_reader.rows_plan(np.arange(3, dtype=np.int64), [4], 0, 4, 8, 100)


# ---- the gate ----
def test_close_waits_for_the_writer_inside_and_shuts_out_the_rest():
    gate = WriteGate()
    inside, release, closed = threading.Event(), threading.Event(), threading.Event()

    def writer() -> None:
        with gate.writing():
            inside.set()
            release.wait(10)

    thread = threading.Thread(target=writer)
    thread.start()
    assert inside.wait(10)
    closer = threading.Thread(target=lambda: (gate.close(), closed.set()))
    closer.start()
    assert not closed.wait(0.2)  # the copy inside is still running: close() waits for it
    release.set()
    assert closed.wait(10)
    thread.join()
    closer.join()
    with pytest.raises(LoadAbandoned):
        gate.enter()


# ---- stores: gated reads into caller spans ----
def _spans_of(staging: torch.Tensor, lens: list[int]) -> list[list[memoryview]]:
    """Each chunk's K and V token slices of a [2, T, H, D] tensor, cut into 3-token pieces (as block pieces)."""
    spans, start = [], 0
    flat = memoryview(staging.view(torch.uint8).numpy()).cast("B")
    half, row = flat.nbytes // 2, flat.nbytes // (2 * staging.shape[1])
    for n in lens:
        pieces = []
        for base in (0, half):
            pieces += [flat[base + a * row:base + min(a + 3, start + n) * row] for a in range(start, start + n, 3)]
        spans.append(pieces)
        start += n
    return spans


def _table_of(staging: torch.Tensor, lens: list[int]) -> SpanTable:
    """_spans_of's pieces as a SpanTable over the staging bytes (what the compiled file reader takes)."""
    flat = memoryview(staging.view(torch.uint8).numpy()).cast("B")
    base = np.frombuffer(flat, np.uint8).ctypes.data
    rows, first = [], [0]
    for chunk in _spans_of(staging, lens):
        rows += [(0, np.frombuffer(span, np.uint8).ctypes.data - base, span.nbytes) for span in chunk]
        first.append(len(rows))
    return SpanTable([flat], np.array(rows, np.int64).reshape(-1, 3), np.array(first, np.int64))


def _drop_cache(path, offset: int = 0) -> None:
    """The page cache of a file from `offset` on (whole pages) dropped: reads of it wait for the medium."""
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, offset, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


@pytest.fixture(scope="module")
def compiled_reader(tmp_path_factory):
    return KVReadLibrary(tmp_path_factory.mktemp("kernels"))


@pytest.fixture(params=["file", "file-no-nowait", "file-cold", "file-c", "file-c-cold", "redis", "redis-c"])
def loaded_store(request, tmp_path):
    redis = request.param.startswith("redis")
    url = request.getfixturevalue("redis_server").url if redis else f"file://{tmp_path}"
    store = open_test_store(url, 2)
    keys, layers = make_chunks(3 * CHUNK + 5, 2)
    write_all(store, keys, layers)
    compiled = request.param.endswith("-c") or request.param.startswith("file-c")
    store.span_reader = request.getfixturevalue("compiled_reader") if compiled else None  # else the Python path
    if request.param == "file-no-nowait":
        store._files.nowait = False  # noqa: SLF001 (as on NFS: every read goes through scratch memory)
    if request.param.endswith("cold"):  # the page cache dropped: RWF_NOWAIT finds nothing, the rest is read cold
        for path in tmp_path.rglob("*.kv"):
            _drop_cache(path)
    yield store, keys, layers
    store.close()


@pytest.mark.parametrize("form", [_spans_of, _table_of])
def test_gated_reads_land_checked_in_the_spans(loaded_store, form):
    store, keys, layers = loaded_store
    lens = [layers[1][key].shape[1] for key in keys]
    staging = torch.zeros(2, sum(lens), *KV_SHAPE)
    nbytes = store.get_layer_spans(1, keys, form(staging, lens), lens, WriteGate())
    assert nbytes == staging.numel() * staging.element_size()
    assert torch.equal(staging, torch.cat([layers[1][key] for key in keys], dim=1))


@pytest.mark.parametrize("form", [_spans_of, _table_of])
def test_a_closed_gate_writes_nothing(loaded_store, form):
    store, keys, layers = loaded_store
    lens = [layers[0][key].shape[1] for key in keys]
    staging = torch.full((2, sum(lens), *KV_SHAPE), 7.0)
    gate = WriteGate()
    gate.close()
    with pytest.raises(LoadAbandoned):
        store.get_layer_spans(0, keys, form(staging, lens), lens, gate)
    assert bool((staging == 7.0).all())
    # and the store (its redis connections too) serves the next load normally
    assert store.get_layer_spans(0, keys, form(staging, lens), lens, WriteGate()) == staging.nbytes


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("damage", ["payload", "header", "short", "long", "missing", "misplaced"])
def test_a_bad_object_fails_its_gated_read(tmp_path, compiled_reader, compiled, damage):
    store = open_test_store(f"file://{tmp_path}", 2)
    store.span_reader = compiled_reader if compiled else None
    keys, layers = make_chunks(2 * CHUNK, 2)
    write_all(store, keys, layers)
    path = next(p for p in tmp_path.rglob("0.kv") if keys[1] in str(p))
    raw = bytearray(path.read_bytes())
    if damage == "missing":
        path.unlink()
    else:
        if damage == "short":
            raw = raw[:-4]
        elif damage == "long":
            raw += b"\0" * 64
        elif damage == "misplaced":  # a valid object, of another layer: its checksum holds, its binding does not
            raw = bytearray(path.with_name("1.kv").read_bytes())
        else:
            raw[-3 if damage == "payload" else 50] ^= 1  # 50: the binding, under the checksum
        path.write_bytes(bytes(raw))
    staging = torch.zeros(2, 2 * CHUNK, *KV_SHAPE)
    error, match = {"payload": (CorruptObject, "checksum"), "header": (CorruptObject, "checksum"),
                    "short": (CorruptObject, "bytes"), "long": (CorruptObject, "bytes"),
                    "missing": (NotFound, "no such object"), "misplaced": (CorruptObject, "another chunk or layer")}[damage]
    fds = _open_fds()
    with pytest.raises(error, match=match):
        store.get_layer_spans(0, keys, _table_of(staging, [CHUNK, CHUNK]), [CHUNK, CHUNK], WriteGate())
    assert _open_fds() == fds  # every object's descriptor closed, the bad one's too
    if compiled and damage in ("short", "long", "missing"):  # found before the layer is read: no byte landed
        assert not staging.any()
    store.close()


class _Watching:
    """The compiled reader, handing each load's result to `note` (what it read of each object)."""

    def __init__(self, reader, note) -> None:
        self._reader, self._note = reader, note

    def __getattr__(self, name):
        return getattr(self._reader, name)

    def load(self, *args):
        loaded = self._reader.load(*args)
        self._note(loaded)
        return loaded


def test_a_store_on_tmpfs_is_read_by_the_compiled_reader(compiled_reader):
    """tmpfs keeps its files in memory and (on some kernels) refuses RWF_NOWAIT: the compiled reader reads
    there plainly, so the store keeps its in-place reads instead of copying every load through scratch."""
    import shutil
    import tempfile
    from pathlib import Path

    root = Path(tempfile.mkdtemp(dir="/dev/shm"))
    mounts = [line.split() for line in Path("/proc/self/mounts").read_text().splitlines()]
    assert max((m for m in mounts if str(root).startswith(m[1])), key=lambda m: len(m[1]))[2] == "tmpfs"
    try:
        with open_test_store(f"file://{root}", 2) as store:
            keys, layers = make_chunks(3 * CHUNK + 5, 2)
            write_all(store, keys, layers)
            store.span_reader = compiled_reader
            lens = [layers[1][key].shape[1] for key in keys]
            staging = torch.zeros(2, sum(lens), *KV_SHAPE)
            store.get_layer_spans(1, keys, _table_of(staging, lens), lens, WriteGate())
            assert torch.equal(staging, torch.cat([layers[1][key] for key in keys], dim=1))
            assert store._files.nowait  # noqa: SLF001 (no read fell back to the scratch path, which clears it)
    finally:
        shutil.rmtree(root)


def test_an_object_partly_in_the_page_cache_is_finished_in_python(tmp_path, compiled_reader):
    """The compiled reader stops where the page cache ends (it never waits for the medium inside the gate);
    the rest of that object is read cold into scratch and copied in, and the layer lands whole."""
    kv_shape = (4, 64)  # 32 KiB objects: several pages each
    store = open_store(f"file://{tmp_path}", fingerprint="cd" * 16, num_layers=1, dtype=torch.float32,
                       kv_shape=kv_shape)
    keys = [f"{i:02d}" + "k" * 30 for i in range(3)]
    chunks = {key: torch.randn(2, CHUNK, *kv_shape) for key in keys}
    write_all(store, keys, [chunks])
    for key in keys[1:]:
        _drop_cache(store.object_name(key, 0), 8192)
    seen = []
    store.span_reader = _Watching(compiled_reader, lambda loaded: seen.append(loaded.got.tolist()))
    staging = torch.zeros(2, 3 * CHUNK, *kv_shape)
    assert store.get_layer_spans(0, keys, _table_of(staging, [CHUNK] * 3), [CHUNK] * 3, WriteGate()) == staging.nbytes
    assert torch.equal(staging, torch.cat([chunks[key] for key in keys], dim=1))
    whole = 64 + chunks[keys[0]].nbytes  # the dropped objects stop short (where depends on the page cache's folios)
    assert len(seen) == 1 and seen[0][0] == whole and all(got < whole for got in seen[0][1:])
    store.close()


def test_objects_of_too_many_pieces_are_left_to_python_and_their_neighbours_read_in_c(tmp_path, compiled_reader):
    """An object cut into more pieces than one preadv takes (kv_read.c, MAX_IOV) is left open for the
    Python path; the objects around it, first and last included, are still read, warmed and checked in
    C, and the layer lands whole."""
    store = open_test_store(f"file://{tmp_path}", 1)
    keys, layers = make_chunks(5 * CHUNK, 1)
    write_all(store, keys, layers)
    staging = torch.zeros(2, 5 * CHUNK, *KV_SHAPE)
    plain = _table_of(staging, [CHUNK] * 5)
    split = [0, 2]  # the first object too: nothing was warmed ahead for the ones after them
    rows, first = [], [0]
    for j in range(5):
        for region, offset, nbytes in plain.desc[plain.first[j]:plain.first[j + 1]].tolist():
            step = 2 if j in split else nbytes  # 2-byte pieces: over a thousand per object
            rows += [(region, at, step) for at in range(offset, offset + nbytes, step)]
        first.append(len(rows))
    table = SpanTable(plain.regions, np.array(rows, np.int64), np.array(first, np.int64))
    assert all(table.first[j + 1] - table.first[j] + 1 > 1024 for j in split)  # pieces and the header
    seen = []
    store.span_reader = _Watching(compiled_reader,
                                  lambda loaded: seen.append((loaded.got.tolist(), (loaded.fds >= 0).tolist())))
    assert store.get_layer_spans(0, keys, table, [CHUNK] * 5, WriteGate()) == staging.nbytes
    assert torch.equal(staging, torch.cat([layers[0][key] for key in keys], dim=1))
    whole = 64 + staging.nbytes // 5
    assert seen == [([0 if j in split else whole for j in range(5)], [j in split for j in range(5)])]
    store.close()


def test_the_compiled_reader_writes_nothing_once_the_gate_closed_under_it(tmp_path, compiled_reader):
    """The gate closed after the load took its words (the compiled reader checks them itself): no byte
    lands, every descriptor is closed."""
    store = open_test_store(f"file://{tmp_path}", 1)
    keys, layers = make_chunks(3 * CHUNK, 1)
    write_all(store, keys, layers)
    staging = torch.zeros(2, 3 * CHUNK, *KV_SHAPE)
    table = _table_of(staging, [CHUNK] * 3)
    gate = WriteGate()
    words = gate.native(compiled_reader.gate_close)
    assert compiled_reader.gate_close(words) == 0  # closed, as WriteGate.close() does it
    fds = _open_fds()
    loaded = compiled_reader.load([store.object_name(key, 0) for key in keys], table.desc, table.first, table.bases(),
                                  np.zeros(64 * len(keys), np.uint8), b"\0" * 56 * len(keys), words)
    assert loaded.status == 1 and _open_fds() == fds
    assert not staging.any()
    store.close()


def test_span_tables_stay_inside_their_regions():
    region = memoryview(bytearray(100))
    with pytest.raises(ValueError, match="outside"):
        SpanTable([region], np.array([[0, 90, 11]], np.int64), np.array([0, 1], np.int64))
    with pytest.raises(ValueError, match="outside"):
        SpanTable([region], np.array([[1, 0, 1]], np.int64), np.array([0, 1], np.int64))
    with pytest.raises(ValueError, match="writable"):
        SpanTable([memoryview(bytes(100))], np.zeros((0, 3), np.int64), np.array([0], np.int64))
    table = SpanTable([region], np.array([[0, 10, 5], [0, 0, 3], [0, 50, 50]], np.int64), np.array([0, 2, 3], np.int64))
    assert table.totals == [8, 50] and [[v.nbytes for v in row] for row in table.views()] == [[5, 3], [50]]
    # a load's other layers reuse the checked table over their own regions: as large, or refused
    other = memoryview(bytearray(range(100)))
    assert bytes(table.with_regions([other]).views()[1][0]) == bytes(range(50, 100))
    with pytest.raises(ValueError, match="outside"):
        table.with_regions([memoryview(bytearray(99))])
    with pytest.raises(ValueError, match="writable"):
        table.with_regions([memoryview(bytes(100))])


# ---- end to end: a read that returns after its load was abandoned ----
class HungStore(FileSystemStore):
    """A real file store whose reads of one object wait for the medium until `release` (a hung NFS
    server: no RWF_NOWAIT, so every read goes through the cold path, and the compiled reader, which
    needs RWF_NOWAIT, stands aside), then complete for real."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        files = self._files  # noqa: SLF001 (the store's reads: this one's hang)
        files.nowait = False
        self._plain_gated, self._plain_cold = files.read_gated, files.read_cold
        files.read_gated, files.read_cold = self._read_gated, self._read_cold
        self.hung_path: str | None = None
        self.hung = threading.Event()  # a read is stuck
        self.release = threading.Event()
        self.returned = threading.Event()  # the stuck read returned
        self.outcome: BaseException | None = None

    def _read_gated(self, fd, views, total, path, gate) -> None:
        if path != self.hung_path:
            return self._plain_gated(fd, views, total, path, gate)
        try:
            self._plain_gated(fd, views, total, path, gate)
        except BaseException as exc:
            self.outcome = exc
            raise
        finally:
            self.returned.set()

    def _read_cold(self, fd, nbytes, offset, path):
        if path == self.hung_path:
            self.hung.set()
            self.release.wait(60)
        return self._plain_cold(fd, nbytes, offset, path)


@pytest.mark.parametrize("kv_load_mode", ["async", "layerwise"])
@pytest.mark.slow  # seconds: outside make test-quick
def test_a_late_read_never_writes_into_blocks_it_gave_up(tiny_llama, tmp_path, kv_load_mode, caplog):
    capture(caplog)
    url = f"file://{tmp_path}"
    producer, consumer = engine_pair(tiny_llama, url, load_timeout_s=1.0, kv_load_mode=kv_load_mode)
    connector = consumer.engine.connector
    opened = connector.store
    store = HungStore(tmp_path, fingerprint=opened.fingerprint, num_layers=opened.num_layers, dtype=opened.dtype,
                      kv_shape=opened.kv_shape, timeout=opened.timeout)
    connector.store = store
    opened.close()
    try:
        full = prompt(600, seed=90)
        producer.generate([full], PREFILL)
        store.hung_path = store.object_name(connector.keys_for(full, None)[1], 2)
        out = consumer.generate([full], GREEDY)
        assert out[0].token_ids == mono_engine(tiny_llama).generate([full], GREEDY)[0].token_ids
        assert [(reason, n) for _, reason, n in lines(caplog, FALLBACK_RE)] == [("timeout", 599)]
        assert store.hung.is_set() and not store.returned.is_set()  # the read is still out there
        # The blocks are recomputed now, or free for the next request: stand for that with a sentinel.
        for cache in connector.kv_caches:
            cache.view(torch.uint8).fill_(SENTINEL)
        store.release.set()
        assert store.returned.wait(30)
        assert isinstance(store.outcome, LoadAbandoned)
        for cache in connector.kv_caches:
            assert bool((cache.view(torch.uint8) == SENTINEL).all())
    finally:
        store.release.set()
        producer.engine.shutdown()
        consumer.engine.shutdown()


@pytest.mark.parametrize("kv_load_mode", ["async", "layerwise"])
@pytest.mark.slow  # seconds: outside make test-quick
def test_layers_still_queued_when_their_load_is_given_up_are_never_read(tiny_llama, tmp_path, kv_load_mode,
                                                                         caplog):
    """A load's layers wait for the store's only I/O thread, held by other work past the load deadline:
    the request recomputes (exact output), and once the thread is free the load's reader finds every
    layer cancelled and reads none of them (store_connector._read_layers skips them)."""
    capture(caplog)
    producer, consumer = engine_pair(tiny_llama, f"file://{tmp_path}?io_threads=1", load_timeout_s=0.5,
                                     kv_load_mode=kv_load_mode)
    connector = consumer.engine.connector
    store, start_loads, release, loads = connector.store, connector._start_loads, threading.Event(), []

    def start_behind_busy_thread(specs):
        store.submit(release.wait, 60)
        loads.extend(start_loads(specs))
        return loads[-len(specs):]

    connector._start_loads = start_behind_busy_thread
    try:
        full = prompt(600, seed=92)
        producer.generate([full], PREFILL)
        out = consumer.generate([full], GREEDY)
        assert out[0].token_ids == mono_engine(tiny_llama).generate([full], GREEDY)[0].token_ids
        assert [(reason, n) for _, reason, n in lines(caplog, FALLBACK_RE)] == [("timeout", 599)]
        release.set()
        store.submit(int).result(30)  # one thread, first in first out: the load's reader has run
        assert len(loads) == 1 and len(loads[0].futures) == connector.num_layers
        assert all(future.cancelled() for future in loads[0].futures.values())
        assert store.stats().objects_read == 0
    finally:
        release.set()
        producer.engine.shutdown()
        consumer.engine.shutdown()


@pytest.mark.slow  # seconds: outside make test-quick
def test_loads_read_in_place_into_host_blocks(tiny_llama, tmp_path):
    """The CPU engine's loads take the in-place path (no staging buffer is ever taken from the pool),
    through the compiled reader."""
    producer, consumer = engine_pair(tiny_llama, f"file://{tmp_path}")
    try:
        full = prompt(700, seed=91)
        producer.generate([full], PREFILL)
        out = consumer.generate([full], GREEDY)
        assert out[0].num_cached_tokens == 699
        assert out[0].token_ids == mono_engine(tiny_llama).generate([full], GREEDY)[0].token_ids
        assert consumer.engine.connector.transfer.pool.num_acquired == 0
        assert isinstance(consumer.engine.connector.store.span_reader, KVReadLibrary)
    finally:
        producer.engine.shutdown()
        consumer.engine.shutdown()


def test_open_store_keeps_dtype_and_shape_for_span_reads(tmp_path):
    store = open_store(f"file://{tmp_path}", fingerprint="ab" * 16, num_layers=1)
    with pytest.raises(ValueError, match="dtype and kv_shape"):
        store.get_layer_spans(0, [], [], [], WriteGate())
    store.close()
