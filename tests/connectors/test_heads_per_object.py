"""`heads_per_object`: a writer splits its KV heads into objects of at most K heads, so a reader keeping fewer heads
than the writer's group reads only the objects of its own heads.

Every rank is a real StoreConnector with its own KVShard and store client (as tests/connectors/test_store_layout.py), over a
real directory, a real redis-server and a real Redis Cluster; every loaded row is compared with the KV the writers
held, and the bytes each reader read (its store's counters) with the sizes of exactly the objects it needed.
"""
from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pytest
import redis
import torch

from pdserve.common.hashing import chunk_keys
from pdserve.connectors import decoded_loads
from pdserve.connectors.chunk_math import LoadPlan, slots_for
from pdserve.connectors.chunked import ChunkedConnectorMetadata, LoadSpec, SaveSpec
from pdserve.connectors.store_connector import StoreConnector
from pdserve.kvstore import open_store, payload_codecs
from pdserve.kvstore.cli import main
from pdserve.kvstore.layout import KVShard, WriterLayout
from tests.helpers import kvstore as helpers
from tests.helpers.kvstore import shard_connector, store_url

pytestmark = pytest.mark.timeout(300)

FP = "00112233445566778899aabbccddeeff"
LAYERS, HEADS, DIM, BLOCK, CHUNK, TOKENS = 3, 4, 8, 4, 8, 21  # 2 full chunks and a partial one
READERS = {"TP=1": (1, 0), "TP=2 rank 0": (2, 0), "TP=2 rank 1": (2, 1), "TP=4 rank 1": (4, 1)}  # heads [0,4) [0,2)
#                                                                             [2,4) [1,2) of 4


def _shard(tp: int, rank: int, pp: int = 1, pp_rank: int = 0) -> KVShard:
    return KVShard.tp_pp(rank, tp, pp_rank, pp, LAYERS, HEADS)


def _connector(url: str, shard: KVShard) -> StoreConnector:
    return shard_connector(url, shard, fingerprint=FP, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
                           chunk_size=CHUNK, block_size=BLOCK)


def _with(url: str, **options) -> str:
    query = "&".join(f"{name}={value}" for name, value in options.items())
    return f"{url}?{query}" if query else url


def _save(url: str, layout: tuple[int, int], truth: list[torch.Tensor], tokens: list[int]) -> None:
    """Each rank of a (TP, PP) writer saves the prompt from its own paged caches (truth: per layer [2, T, H, D])."""
    tp, pp = layout
    for rank in range(tp * pp):
        shard = _shard(tp, rank % tp, pp, rank // tp)
        connector = _connector(url, shard)
        num_blocks = -(-TOKENS // BLOCK) + 3
        slots = slots_for(random.Random(rank).sample(range(num_blocks), -(-TOKENS // BLOCK)), 0, TOKENS, BLOCK)
        h0, h1 = shard.heads
        caches = [torch.zeros(2, num_blocks, BLOCK, h1 - h0, DIM) for _ in range(*shard.layers)]
        connector.register_kv_caches(caches)
        meta = ChunkedConnectorMetadata(saves=[SaveSpec("req", tokens, None, 0, TOKENS, 0, slots)])
        connector.start_load_kv(meta)
        for layer, cache in zip(range(*shard.layers), caches):
            cache.view(2, -1, h1 - h0, DIM)[:, slots] = truth[layer][:, :, h0:h1]
            connector.save_kv_layer(layer, cache, meta)
        connector.wait_for_save()
        for pending in connector._pending_saves.get("req", []):  # noqa: SLF001
            pending.done.result(timeout=10)
        connector.shutdown()


def _load(url: str, shard: KVShard, tokens: list[int]) -> tuple[list[torch.Tensor], int]:
    """One reader rank loads the whole prompt into fresh paged caches: (per layer its rows [2, T - 1, h, D], the
    bytes its store read)."""
    connector = _connector(url, shard)
    plan = LoadPlan(TOKENS, 0, min(connector.store.lookup(chunk_keys(FP, tokens, CHUNK)) * CHUNK, TOKENS), CHUNK)
    assert plan.need_to_load == TOKENS - 1, f"{shard.describe()}: not every chunk is committed"
    num_blocks = -(-TOKENS // BLOCK) + 5
    slots = slots_for(random.Random(100 + shard.rank).sample(range(num_blocks), -(-TOKENS // BLOCK)),
                      *plan.write_range, BLOCK)
    h0, h1 = shard.heads
    caches = [torch.zeros(2, num_blocks, BLOCK, h1 - h0, DIM) for _ in range(*shard.layers)]
    connector.register_kv_caches(caches)
    connector.start_load_kv(ChunkedConnectorMetadata(loads=[LoadSpec("req", tokens, None, plan, slots)]))
    for layer in range(*shard.layers):
        connector.wait_for_layer_load(layer)
    assert not connector.get_failed_loads(), f"{shard.describe()}: the load failed"
    rows = [cache.view(2, -1, h1 - h0, DIM)[:, slots].clone() for cache in caches]
    read = connector.store.stats().bytes_read
    connector.shutdown()
    return rows, read


def _object_bytes(url: str, tokens: list[int], layers: range, groups: list[tuple[int, int]]) -> int:
    """The stored bytes of the objects of `groups` (header included), as any reader's store counts them."""
    with open_store(url, fingerprint=FP, num_layers=LAYERS, dtype=torch.float32, kv_shape=(HEADS, DIM)) as store:
        keys = chunk_keys(FP, tokens, CHUNK)
        return sum(store.get_layer_decoded(layer, keys, heads=group)[1] for layer in layers for group in groups)


def _prompt(seed: int) -> tuple[list[int], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [seed * 1000 + i for i in range(TOKENS)], [torch.randn(2, TOKENS, HEADS, DIM, generator=gen)
                                                      for _ in range(LAYERS)]


@pytest.mark.parametrize("codec", ["raw", "int8"])
@pytest.mark.parametrize("kind", ["file", "redis", "cluster"])
@pytest.mark.slow  # seconds: outside make test-quick
def test_every_reader_of_a_split_writer_reads_its_own_objects_exactly(kind, codec, tmp_path, request):
    url = store_url(kind, tmp_path, request)
    seed = {"raw": 1, "int8": 2}[codec] * 10
    for k, writer in [(2, (1, 1)), (1, (1, 1)), (1, (2, 1)), (2, (1, 2))]:
        seed += 1
        tokens, truth = _prompt(seed)
        _save(_with(url, heads_per_object=k, codec=codec), writer, truth, tokens)
        if codec != "raw":  # lossy, with one scale per (K or V, token, head): any split of the heads decodes alike
            truth = [_round_trip(t, codec) for t in truth]
        written = WriterLayout(LAYERS, HEADS, head_starts=tuple(range(0, HEADS, HEADS // writer[0])), codec=codec,
                               object_heads=k)
        for name, (tp, rank) in READERS.items():
            shard = _shard(tp, rank)
            rows, read = _load(url, shard, tokens)
            h0, h1 = shard.heads
            for layer, got in enumerate(rows):
                assert torch.equal(got, truth[layer][:, :TOKENS - 1, h0:h1]), (k, writer, name, layer)
            needed = [group for group, _ in written.reads(shard.heads, HEADS)]
            assert all(h0 <= a and b <= h1 for a, b in needed) == (k <= h1 - h0), (k, name)
            assert read == _object_bytes(url, tokens, range(LAYERS), needed), (k, writer, name)


def test_a_narrow_reader_moves_half_the_bytes_of_an_unsplit_store_and_says_so_once(tmp_path, caplog, monkeypatch):
    url = f"file://{tmp_path}"
    monkeypatch.setattr(decoded_loads, "_WIDE_READS", type(decoded_loads._WIDE_READS)())  # this test's own flag
    caplog.set_level(logging.WARNING, logger="pdserve")
    reads = {}
    for k, seed in ((0, 30), (2, 31)):
        tokens, truth = _prompt(seed)
        _save(_with(url, heads_per_object=k), (1, 1), truth, tokens)
        for rank in (0, 1):  # TP=2: heads [0, 2) and [2, 4), each its own object with K=2
            rows, reads[k, rank] = _load(url, _shard(2, rank), tokens)
            assert all(torch.equal(got, truth[layer][:, :TOKENS - 1, 2 * rank:2 * rank + 2])
                       for layer, got in enumerate(rows))
    objects = LAYERS * 3  # one object per chunk and layer, either way
    header = 64
    for rank in (0, 1):
        assert reads[0, rank] - objects * header == 2 * (reads[2, rank] - objects * header)
    wide = [r.getMessage() for r in caplog.records if "loads move" in r.getMessage()]
    assert wide == ["KV store objects hold KV heads [0, 4) of 4 where this rank keeps [0, 2): loads move 2.0x the "
                    "bytes they keep; store with heads_per_object=2 on the writer"]  # one per process, not per load


@pytest.mark.parametrize("kind", ["file", "redis"])
def test_a_chunk_missing_one_split_object_is_never_committed(kind, tmp_path, request):
    url = store_url(kind, tmp_path, request)
    tokens, truth = _prompt(40)
    keys = chunk_keys(FP, tokens, CHUNK)
    bounds = [(j * CHUNK, min((j + 1) * CHUNK, TOKENS)) for j in range(len(keys))]
    store = open_store(_with(url, heads_per_object=1), fingerprint=FP, num_layers=LAYERS, dtype=torch.float32,
                       kv_shape=(HEADS, DIM))
    layout = WriterLayout(LAYERS, HEADS, head_starts=(0, 2))  # two TP ranks, each of 2 heads in 1-head objects

    def write(heads: tuple[int, int]) -> None:
        for layer in range(LAYERS):
            store.put_layer(layer, {key: truth[layer][:, a:b, heads[0]:heads[1]].contiguous()
                                    for key, (a, b) in zip(keys, bounds)}, heads=heads)

    write((0, 2))
    write((2, 4))
    _drop(url, keys[1], "2.h3-4")
    store.commit(keys, layout=layout, part=0)  # part 0 is whole; part 1 is not there yet
    with pytest.raises(Exception, match="miss layers"):
        store.commit(keys, layout=layout, part=1)  # chunk 1 misses one of part 1's objects
    assert store.lookup(keys) == 1  # chunk 0 complete; chunk 1 never counts
    assert store.layouts(keys[:1]) == [WriterLayout(LAYERS, HEADS, (0,), (0, 2), object_heads=1)]
    store.close()


def _round_trip(tensor: torch.Tensor, codec: str) -> torch.Tensor:
    """What a chunk of `tensor` reads back as when stored whole with `codec`."""
    encoded = memoryview(bytearray(payload_codecs.encode(tensor, codec)))
    return payload_codecs.decode(encoded, codec, tensor.dtype, tuple(tensor.shape))


def _drop(url: str, key: str, name: str, fingerprint: str = FP) -> None:
    """Remove one stored object behind the store's back (a writer that died between two puts)."""
    if url.startswith("file://"):
        Path(url[len("file://"):], fingerprint, key[:2], key, f"{name}.kv").unlink()
    else:
        assert redis.Redis.from_url(url).delete(f"pdkv:{fingerprint}:{{{key}}}:{name}") == 1


@pytest.mark.parametrize("kind", ["file", "redis"])
def test_pd_kvstore_and_deletes_handle_split_objects(kind, tmp_path, request, capsys):
    """stats, ls, verify (--repair) and delete see every split object; a bounded file store counts them."""
    url = store_url(kind, tmp_path, request)
    fp = helpers.FP  # 2 KV heads of 8 values; chunks of 16 tokens
    store = helpers.open_test_store(_with(url, heads_per_object=1), 2)
    prompts = [helpers.make_chunks(40, 2, seed=seed) for seed in (500, 501, 502)]  # 3 chunks x 2 layers x 2 objects
    for keys, layers in prompts:
        helpers.write_all(store, keys, layers)
    assert main([url, "stats", "--json", "--fingerprint", fp]) == 0
    stats = json.loads(capsys.readouterr().out)[fp]
    assert (stats["chunks"], stats["objects"]) == (9, 36)
    assert main([url, "ls", "--fingerprint", fp]) == 0
    assert [line.split()[2:4] for line in capsys.readouterr().out.splitlines()] == [["committed", "4"]] * 9
    assert main([url, "verify", "--fingerprint", fp]) == 0
    assert "verified 36 object(s)" in capsys.readouterr().out

    keys = prompts[0][0]
    _drop(_with(url), keys[0], "1.h1-2", fp)
    assert main([url, "verify", "--fingerprint", fp]) == 1
    assert f"DAMAGED {fp}/{keys[0]}: layer 1.h1-2 of 2 missing" in capsys.readouterr().out
    assert main([url, "verify", "--fingerprint", fp, "--repair"]) == 0
    assert store.lookup(keys) == 0
    assert store.delete(prompts[1][0]) == 3
    left = {info.key: info.objects for info in store.list_chunks(fp)}
    assert left == {**{key: 4 for key in keys[1:]}, **{key: 4 for key in prompts[2][0]}}  # nothing of the deleted
    assert store.lookup(keys[1:]) == 2 and store.lookup(prompts[2][0]) == 3
    store.close()


def test_a_bounded_file_store_counts_and_evicts_split_chunks(tmp_path):
    prompt_bytes = 2 * 2 * sum(64 + 2 * n * 1 * 8 * 4 for n in (16, 16, 8))  # 2 layers x 2 one-head objects
    store = helpers.open_test_store(f"file://{tmp_path}?heads_per_object=1&max_bytes={prompt_bytes * 5 // 2}", 2)
    prompts = [helpers.make_chunks(40, 2, seed=seed) for seed in (600, 601, 602)]
    for keys, layers in prompts:
        helpers.write_all(store, keys, layers)
        on_disk = sum(p.stat().st_size for p in (tmp_path / helpers.FP).rglob("*.kv"))
        assert on_disk <= store.max_bytes
    assert [store.lookup(keys) for keys, _ in prompts] == [0, 3, 3]  # the least recently used chunks went
    assert store.inventory()[helpers.FP].committed_bytes == on_disk
    store.close()
