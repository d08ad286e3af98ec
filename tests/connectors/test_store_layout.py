"""The layout-free hand-off: KV saved by the ranks of one (TP, PP) layout, loaded by the ranks of another.

Every rank is a real StoreConnector with its own KVShard and its own store client, over a real directory, a
real redis-server and a real Redis Cluster; each writer rank saves from its own paged caches (its layers,
its heads), each reader rank loads into fresh paged caches, and every byte it loaded is compared with the
KV the writers held. In-process: the ranks' engines are not needed to move the bytes.
"""
from __future__ import annotations

import itertools
import os
import random

import pytest
import torch

from pdserve.common.hashing import chunk_keys
from pdserve.connectors.chunk_math import LoadPlan, slots_for
from pdserve.connectors.chunked import ChunkedConnectorMetadata, LoadSpec, SaveSpec
from pdserve.connectors.store_connector import StoreConnector
from pdserve.kvstore.layout import KVShard, WriterLayout
from tests.helpers.kvstore import shard_connector, store_url

pytestmark = pytest.mark.timeout(300)

FP = "00112233445566778899aabbccddeeff"
LAYERS, HEADS, DIM, BLOCK, CHUNK, TOKENS = 4, 2, 8, 4, 8, 21  # 2 full chunks and a partial one
LAYOUTS = [(1, 1), (2, 1), (1, 2), (4, 1)]  # (TP, PP); TP 4 over 2 KV heads replicates each head twice


def _shards(tp: int, pp: int) -> list[KVShard]:
    return [KVShard.tp_pp(r % tp, tp, r // tp, pp, LAYERS, HEADS) for r in range(tp * pp)]


def _connector(url: str, shard: KVShard) -> StoreConnector:
    return shard_connector(url, shard, fingerprint=FP, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
                           chunk_size=CHUNK, block_size=BLOCK)


def _caches(shard: KVShard, num_blocks: int) -> list[torch.Tensor]:
    heads = shard.heads[1] - shard.heads[0]
    return [torch.zeros(2, num_blocks, BLOCK, heads, DIM) for _ in range(*shard.layers)]


def _save(url: str, layout: tuple[int, int], truth: list[torch.Tensor], tokens: list[int],
          skip_rank: int | None = None) -> None:
    """Each writing rank of `layout` saves the prompt from its own paged caches (truth: per layer [2, T, H, D])."""
    for shard in _shards(*layout):
        if shard.rank == skip_rank:
            continue
        connector = _connector(url, shard)
        num_blocks = -(-TOKENS // BLOCK) + 3
        blocks = random.Random(shard.rank).sample(range(num_blocks), -(-TOKENS // BLOCK))
        slots = slots_for(blocks, 0, TOKENS, BLOCK)
        caches = _caches(shard, num_blocks)
        connector.register_kv_caches(caches)
        h0, h1 = shard.heads
        spec = SaveSpec("req", tokens, None, 0, TOKENS, 0, slots)
        meta = ChunkedConnectorMetadata(saves=[spec])
        connector.start_load_kv(meta)
        for layer, cache in zip(range(*shard.layers), caches):
            flat = cache.view(2, -1, h1 - h0, DIM)
            flat[:, slots] = truth[layer][:, :, h0:h1]
            connector.save_kv_layer(layer, cache, meta)
        connector.wait_for_save()
        for pending in connector._pending_saves.get("req", []):  # noqa: SLF001
            pending.done.result(timeout=10)
        connector.shutdown()


def _load(url: str, layout: tuple[int, int], truth: list[torch.Tensor], tokens: list[int]) -> int:
    """Each rank of `layout` loads the prompt into fresh paged caches; checks every loaded row. The hit."""
    hits = set()
    for shard in _shards(*layout):
        connector = _connector(url, shard)
        keys = chunk_keys(FP, tokens, CHUNK)
        hit = min(connector.store.lookup(keys) * CHUNK, TOKENS)
        hits.add(hit)
        if hit:
            plan = LoadPlan(TOKENS, 0, hit, CHUNK)
            num_blocks = -(-TOKENS // BLOCK) + 5
            blocks = random.Random(100 + shard.rank).sample(range(num_blocks), -(-TOKENS // BLOCK))
            slots = slots_for(blocks, *plan.write_range, BLOCK)
            caches = _caches(shard, num_blocks)
            connector.register_kv_caches(caches)
            connector.start_load_kv(ChunkedConnectorMetadata(loads=[LoadSpec("req", tokens, None, plan, slots)]))
            for layer in range(*shard.layers):
                connector.wait_for_layer_load(layer)
            assert not connector.get_failed_loads(), f"{shard.describe()}: the load failed"
            h0, h1 = shard.heads
            for layer, cache in zip(range(*shard.layers), caches):
                got = cache.view(2, -1, h1 - h0, DIM)[:, slots]
                assert torch.equal(got, truth[layer][:, :plan.need_to_load, h0:h1]), (shard.describe(), layer)
        connector.shutdown()
    assert len(hits) == 1, f"ranks disagree on the hit: {hits}"
    return hits.pop()


def _prompt(seed: int) -> tuple[list[int], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    tokens = [seed * 1000 + i for i in range(TOKENS)]
    return tokens, [torch.randn(2, TOKENS, HEADS, DIM, generator=gen) for _ in range(LAYERS)]


@pytest.mark.parametrize("kind", ["file", "redis", "cluster"])
@pytest.mark.slow  # seconds: outside make test-quick
def test_every_layout_reads_what_every_layout_wrote(kind, tmp_path, request):
    url = store_url(kind, tmp_path, request)
    for seed, (writer, reader) in enumerate(itertools.product(LAYOUTS, LAYOUTS), start=1):
        tokens, truth = _prompt(seed)
        _save(url, writer, truth, tokens)
        assert _load(url, reader, truth, tokens) == TOKENS, (writer, reader)


@pytest.mark.parametrize("kind", ["file", "redis"])
def test_a_chunk_misses_while_one_writer_part_is_missing(kind, tmp_path, request):
    url = store_url(kind, tmp_path, request)
    tokens, truth = _prompt(50)
    _save(url, (2, 1), truth, tokens, skip_rank=1)  # rank 1's heads never arrive: the rank died
    assert _load(url, (1, 1), truth, tokens) == 0
    assert _load(url, (2, 1), truth, tokens) == 0
    _save(url, (1, 2), truth, tokens, skip_rank=0)  # and a PP stage missing
    assert _load(url, (1, 1), truth, tokens) == 0
    _save(url, (2, 1), truth, tokens)  # written whole at last: every layout hits
    assert _load(url, (1, 2), truth, tokens) == TOKENS


def test_the_marker_records_the_writer_layout_and_parts_are_named_by_heads(tmp_path):
    url = f"file://{tmp_path}"
    tokens, truth = _prompt(60)
    _save(url, (2, 2), truth, tokens)
    key = chunk_keys(FP, tokens, CHUNK)[0]
    chunk = tmp_path / FP / key[:2] / key
    names = sorted(p.name for p in chunk.iterdir())
    assert names == sorted(["commit", *(f"commit.{a}-{b}.h{h}-{h + 1}" for a, b in ((0, 2), (2, 4)) for h in range(2)),
                            *(f"{layer}.h{h}-{h + 1}.kv" for layer in range(LAYERS) for h in range(HEADS))])
    connector = _connector(url, KVShard())
    assert connector.store.layouts([key]) == [WriterLayout(LAYERS, HEADS, (0, 2), (0, 1))]
    assert connector.store.verify().corrupt == []
    connector.shutdown()


@pytest.mark.parametrize("reader", [(1, 1), (4, 1)])
def test_a_flipped_byte_in_a_cross_layout_read_is_caught(reader, tmp_path):
    url = f"file://{tmp_path}"
    tokens, truth = _prompt(70 + reader[0])
    _save(url, (2, 1), truth, tokens)
    key = chunk_keys(FP, tokens, CHUNK)[1]
    victim = tmp_path / FP / key[:2] / key / "2.h1-2.kv"
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0x01
    victim.write_bytes(bytes(data))
    for shard in _shards(*reader):
        if not shard.heads[0] <= 1 < shard.heads[1]:
            continue  # only the ranks holding head 1 read the damaged object
        connector = _connector(url, shard)
        keys = chunk_keys(FP, tokens, CHUNK)
        plan = LoadPlan(TOKENS, 0, connector.store.lookup(keys) * CHUNK, CHUNK)
        caches = _caches(shard, 16)
        connector.register_kv_caches(caches)
        slots = slots_for(list(range(6)), *plan.write_range, BLOCK)
        connector.start_load_kv(ChunkedConnectorMetadata(loads=[LoadSpec("req", tokens, None, plan, slots)]))
        for layer in range(*shard.layers):
            connector.wait_for_layer_load(layer)
        assert connector.get_failed_loads() == {"req"}, shard.describe()
        connector.shutdown()
        break  # the failed load's repair un-committed the chunk: the other ranks no longer find it
    assert not os.path.exists(victim.parent / "commit")


def test_shards_of_vllm_layouts():
    assert _shards(1, 1)[0].resolve(LAYERS, HEADS) == KVShard().resolve(LAYERS, HEADS)
    tp4 = _shards(4, 1)
    assert [(s.heads, s.writes) for s in tp4] == [((0, 1), True), ((0, 1), False), ((1, 2), True), ((1, 2), False)]
    pp = KVShard.tp_pp(0, 1, 2, 3, 7, 2)
    assert pp.layers == (5, 7) and pp.layer_starts == (0, 2, 5)  # uneven: vLLM's split, [2, 3, 2]
    assert KVShard.tp_pp(0, 1, 0, 2, 5, 2).layers == (0, 3)
    with pytest.raises(ValueError, match="do not split"):
        KVShard.tp_pp(0, 3, 0, 1, 4, 4)
    assert WriterLayout.decode(WriterLayout(4, 2, (0, 2), (0, 1)).encode()) == WriterLayout(4, 2, (0, 2), (0, 1))
    assert WriterLayout(30).encode() == "30"  # the single-process marker, as before layouts existed


def test_uneven_pipeline_stages_hand_off_both_ways(tmp_path):
    url = f"file://{tmp_path}"
    assert [s.layers for s in _shards(1, 3)] == [(0, 1), (1, 3), (3, 4)]  # 4 layers over 3 stages
    for seed, (writer, reader) in enumerate([((1, 3), (2, 1)), ((2, 1), (1, 3)), ((1, 3), (4, 1))], start=80):
        tokens, truth = _prompt(seed)
        _save(url, writer, truth, tokens)
        assert _load(url, reader, truth, tokens) == TOKENS, (writer, reader)
