"""The batched coded load (kvstore/coded_reads.py, connectors/decoded_loads.py): a layer's coded objects in one read
and one C decode, straight into the blocks or the staging buffer.

Over a real directory and a real redis-server: it writes bit for bit what the per-object path (get_layer_decoded)
decodes, lossless equal to the raw tensor; through a P/D pair of the tiny model, a flipped byte in one coded
object fails that request's load only (it recomputes, exact) and a chunk written raw next to one written with a
codec still loads (raw + lossless: token-identical to HF).
"""
from __future__ import annotations

import re

import pytest
import torch

from pdserve.connectors.staging import ReadTarget
from pdserve.kvstore import CorruptObject, payload_codecs
from pdserve.kvstore.gate import NO_GATE
from tests.helpers.connector import (FALLBACK_RE, GREEDY, PREFILL, capture, engine_pair, hf_greedy, lines, prompt,
                                     token_ids)
from tests.helpers.kvstore import KV_SHAPE, make_chunks, open_test_store, write_all

pytestmark = pytest.mark.timeout(240)


def _staging(chunk_lens: list[int], dtype: torch.dtype) -> ReadTarget:
    full = torch.full((2, sum(chunk_lens), *KV_SHAPE), float("nan"), dtype=dtype)
    return ReadTarget(full.view(-1).view(torch.uint8), full, list(chunk_lens))


def _url(kind: str, tmp_path, request, codec: str) -> str:
    base = f"file://{tmp_path}" if kind == "file" else request.getfixturevalue("redis_module").url
    return base + ("&" if "?" in base else "?") + f"codec={codec}"


@pytest.mark.parametrize("kind", ["file", "redis"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("codec", ["lossless", "int8", "fp8"])
@pytest.mark.parametrize("compiled", [True, False])
def test_the_batched_decode_equals_the_per_object_one_bit_for_bit(codec, dtype, kind, compiled, tmp_path, request,
                                                                   monkeypatch):
    if not compiled:  # the path without a library (PDSERVE_KERNELS=torch) must write the same bytes
        monkeypatch.setattr(payload_codecs, "_dequant_library", lambda: None)
    else:
        assert payload_codecs._dequant_library() is not None  # noqa: SLF001 (gcc is part of this machine's setup)
    keys, layers = make_chunks(45, 2, dtype=dtype, seed=3)  # chunks of 16, 16 and 13 tokens
    chunk_lens = [16, 16, 13]
    with open_test_store(_url(kind, tmp_path, request, codec), 2, dtype=dtype) as store:
        write_all(store, keys, layers)
        for layer in range(2):
            target = _staging(chunk_lens, dtype)
            stored, codecs = store.get_layer_coded(layer, keys, target.span_table(), chunk_lens, NO_GATE)
            want, want_stored, _ = store.get_layer_decoded(layer, keys)
            assert codecs == {codec} and stored == want_stored
            for got, expected, original in zip(target.out, want, layers[layer].values()):
                assert got.view(torch.uint8).equal(expected.contiguous().view(torch.uint8))  # bit for bit
                if codec == "lossless":
                    assert got.view(torch.uint8).equal(original.view(torch.uint8))


@pytest.mark.parametrize("kind", ["file", "redis"])
@pytest.mark.parametrize("codec", ["int8", "fp8"])
def test_8bit_objects_are_read_whole_in_c_and_a_damaged_one_is_still_found(codec, kind, tmp_path, request):
    """With the chunks' codecs from their markers, an 8-bit layer is read whole by the store's compiled reader
    (redis: the receiver; file: the page-cache reader; no Python read at all) and decodes bit for bit as the
    per-object path does; a damaged object, or a marker that names another codec, sends the layer back to
    the checked read, which says why."""
    import redis

    keys, layers = make_chunks(45, 1, seed=5)
    chunk_lens = [16, 16, 13]
    url = _url(kind, tmp_path, request, codec)
    with open_test_store(url, 1) as store:
        write_all(store, keys, layers)
        want = store.get_layer_decoded(0, keys)[0]

        def read(codecs: list[str]) -> torch.Tensor:
            target = _staging(chunk_lens, torch.float32)
            store.get_layer_coded(0, keys, target.span_table(), chunk_lens, NO_GATE, codecs=codecs)
            return target.out

        def no_python_read(items):
            raise AssertionError("the Python batched read ran")

        store._get = no_python_read  # noqa: SLF001 (the instance's own read path, not a stand-in)
        got = read([codec] * 3)
        del store._get
        for a, b in zip(got, want):
            assert a.view(torch.uint8).equal(b.contiguous().view(torch.uint8))
        for a, b in zip(read(["raw", codec, "raw"]), want):  # a marker naming another codec: read again
            assert a.view(torch.uint8).equal(b.contiguous().view(torch.uint8))
        if kind == "redis":
            client = redis.Redis.from_url(url.split("?")[0])
            name = store._key(keys[2], 0)  # noqa: SLF001
            value = client.get(name)
            client.set(name, value[:-1] + bytes([value[-1] ^ 0x01]))
        else:
            (path,) = tmp_path.rglob(f"{keys[2]}/0.kv")
            value = path.read_bytes()
            path.write_bytes(value[:-1] + bytes([value[-1] ^ 0x01]))
        with pytest.raises(CorruptObject, match="checksum mismatch"):
            read([codec] * 3)


def test_a_damaged_object_fails_the_batched_read_before_anything_is_written(tmp_path):
    keys, layers = make_chunks(45, 1, seed=4)
    with open_test_store(f"file://{tmp_path}?codec=int8", 1) as store:
        write_all(store, keys, layers)
        (path,) = tmp_path.rglob(f"{keys[2]}/0.kv")
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x01  # the last code of the last chunk
        path.write_bytes(bytes(data))
        target = _staging([16, 16, 13], torch.float32)
        with pytest.raises(CorruptObject, match="checksum mismatch"):
            store.get_layer_coded(0, keys, target.span_table(), [16, 16, 13], NO_GATE)
        assert torch.isnan(target.full).all()  # the checks come first: the good chunks were not written either


def test_a_flipped_byte_in_one_coded_object_fails_only_that_load(tiny_llama, tmp_path, caplog):
    """Two requests load in one step from an int8 store; one object of the second is damaged: that request
    recomputes (and is then exact), the other's load goes through."""
    good, bad = prompt(300, seed=30), prompt(280, seed=31)
    producer, consumer = engine_pair(tiny_llama, f"file://{tmp_path}?codec=int8")
    try:
        producer.generate([good, bad], PREFILL)
        key = producer.engine.connector.keys_for(bad, None)[1]
        (path,) = tmp_path.rglob(f"{key}/3.kv")
        data = bytearray(path.read_bytes())
        data[200] ^= 0x40
        path.write_bytes(bytes(data))
        capture(caplog)
        out = consumer.generate([good, bad], GREEDY)
        failed = lines(caplog, FALLBACK_RE)
        assert len(failed) == 1 and failed[0][1] == "corrupt"
        assert out[0].num_cached_tokens == 299  # loaded
        assert token_ids(out)[1] == hf_greedy(tiny_llama, [bad])[0]  # recomputed: exact
    finally:
        producer.engine.shutdown()
        consumer.engine.shutdown()


@pytest.mark.parametrize("codec", ["lossless", "int8"])
@pytest.mark.slow  # seconds: outside make test-quick
def test_a_chunk_written_raw_next_to_a_coded_one_loads(codec, tiny_llama, tmp_path, caplog):
    """Chunk 0 by a raw writer, chunk 1 by a writer of `codec` (a store whose setting changed): one load reads
    both, and names both codecs; raw + lossless is token-identical to HF."""
    full = prompt(300, seed=40)
    raw_producer, consumer = engine_pair(tiny_llama, f"file://{tmp_path}")
    coded_producer, _ = engine_pair(tiny_llama, f"file://{tmp_path}?codec={codec}")
    try:
        raw_producer.generate([full[:256]], PREFILL)  # chunk [0, 256): raw
        coded_producer.generate([full], PREFILL)  # only chunk [256, 300) is new: coded
        capture(caplog)
        out = consumer.generate([full], GREEDY)
        assert out[0].num_cached_tokens == 299 and not lines(caplog, FALLBACK_RE)
        named = {m.group(1) for r in caplog.records if (m := re.search(r"Retrieved .*, codec: (\S+)$",
                                                                        r.getMessage()))}
        assert named == {"+".join(sorted([codec, "raw"]))}
        if codec == "lossless":
            assert token_ids(out) == hf_greedy(tiny_llama, [full])
    finally:
        for llm in (raw_producer, consumer, coded_producer, _):
            llm.engine.shutdown()


def test_a_lossless_hand_off_through_the_staged_path_is_exact(tiny_llama, tmp_path, caplog, monkeypatch):
    """The CUDA data path (StagedTransfer: decode into the pinned staging buffer, then the copy stream's
    scatter), run on the CPU: a lossless load is token-identical to HF and goes through the batched read."""
    from pdserve.connectors import staging
    from pdserve.kvstore.coded_reads import CodedReader

    monkeypatch.setattr(staging, "use_staging", lambda platform: True)
    calls, batched = [], CodedReader.get_layer_coded

    def counted(self, layer, *args, **kwargs):  # the real read, noting which layers took it
        calls.append(layer)
        return batched(self, layer, *args, **kwargs)

    monkeypatch.setattr(CodedReader, "get_layer_coded", counted)
    prompts = [prompt(300, seed=50)]
    producer, consumer = engine_pair(tiny_llama, f"file://{tmp_path}?codec=lossless")
    try:
        assert isinstance(consumer.engine.connector.transfer, staging.StagedTransfer)
        capture(caplog)
        producer.generate(prompts, PREFILL)
        out = consumer.generate(prompts, GREEDY)
        assert out[0].num_cached_tokens == 299 and not lines(caplog, FALLBACK_RE)
        assert token_ids(out) == hf_greedy(tiny_llama, prompts)
        assert sorted(calls) == list(range(consumer.engine.connector.num_layers))  # every layer, batched
    finally:
        producer.engine.shutdown()
        consumer.engine.shutdown()
