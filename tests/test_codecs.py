"""Stored KV codecs (kvstore/kv_codecs.py): chosen per store with ?codec=, named in every object's header.

Over a real directory, a real redis-server and a real Redis Cluster: what a store of each codec writes, a
store opened with no codec reads (a mixed store too); lossless is bit-exact and token-identical to HF
through a P/D pair; int8 and fp8 stay within their quantization step; a damaged scale is caught;
`pd-kvstore stats` counts bytes by codec and the ratio; the load line names the codec.
"""
from __future__ import annotations

import re

import pytest
import torch

from pdserve.connectors.kv_hits import parse_line
from pdserve.kvstore import CorruptObject, open_store
from pdserve.kvstore.cli import main as pd_kvstore
from tests.connector_helpers import (GREEDY, PREFILL, capture, check_full_handoff, engine_pair, hf_greedy, prompt,
                                     token_ids)
from tests.kvstore_helpers import FP, KV_SHAPE, make_chunks, open_test_store, write_all

pytestmark = pytest.mark.timeout(240)
CODECS = ["raw", "lossless", "int8", "fp8"]


def _url(kind: str, tmp_path, request, codec: str) -> str:
    if kind == "file":
        base = f"file://{tmp_path}"
    elif kind == "redis":
        base = request.getfixturevalue("redis_module").url
    else:
        base = request.getfixturevalue("redis_cluster").url
    return base + ("&" if "?" in base else "?") + f"codec={codec}"


def _close_enough(got: torch.Tensor, want: torch.Tensor, codec: str) -> None:
    if codec in ("raw", "lossless"):
        assert torch.equal(got, want)
        return
    step = want.float().abs().amax(-1, keepdim=True)  # one group: (K or V, token, head)
    bound = step / 127 / 2 if codec == "int8" else step / 16  # e4m3: 3 mantissa bits, scaled so max -> 448
    rounding = want.float().abs() * 2.0 ** -8 if want.dtype == torch.bfloat16 else 0  # back to bf16: half an ulp
    assert ((got.float() - want.float()).abs() <= bound * 1.001 + rounding + 1e-6).all()


@pytest.mark.parametrize("kind", ["file", "redis", "cluster"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_codec_round_trips_and_a_plain_reader_needs_no_configuration(kind, dtype, tmp_path, request):
    keys, layers = make_chunks(40, 2, dtype=dtype)
    plain = open_test_store(_url(kind, tmp_path, request, "raw").split("?")[0], 2, dtype=dtype)
    for seed, codec in enumerate(CODECS):
        keys, layers = make_chunks(40, 2, dtype=dtype, seed=seed)
        with open_test_store(_url(kind, tmp_path, request, codec), 2, dtype=dtype) as writer:
            assert writer.codec == codec
            write_all(writer, keys, layers)
        assert plain.lookup(keys) == len(keys)
        assert {layout.codec for layout in plain.layouts(keys)} == {codec}
        for layer in range(2):
            tensors, stored, codecs = plain.get_layer_decoded(layer, keys)
            assert codecs == {codec}
            raw = sum(t.nbytes for t in layers[layer].values())
            assert (stored < raw) if codec in ("int8", "fp8") else (stored <= raw + 64 * len(keys) + 64)
            for key, got in zip(keys, tensors):
                assert got.dtype == dtype and got.shape == layers[layer][key].shape
                _close_enough(got, layers[layer][key], codec)
    assert plain.verify().corrupt == []  # every codec's objects check out, read by a plain store
    plain.close()


@pytest.mark.parametrize("codec", ["int8", "fp8", "lossless"])
def test_a_flipped_byte_of_a_coded_payload_is_caught(codec, tmp_path):
    keys, layers = make_chunks(16, 1)
    with open_test_store(f"file://{tmp_path}?codec={codec}", 1) as store:
        write_all(store, keys, layers)
        (path,) = tmp_path.rglob(f"{keys[0]}/0.kv")
        data = bytearray(path.read_bytes())
        data[64 + 1] ^= 0x10  # int8/fp8: inside the scales; lossless: inside the zstd frame
        path.write_bytes(bytes(data))
        with pytest.raises(CorruptObject, match="checksum mismatch"):
            store.get_layer_decoded(0, keys)
        assert len(store.verify().corrupt) == 1


def test_a_bad_codec_in_the_url_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"bad value for codec in .*unknown KV codec 'zip'; known: raw, lossless, "
                                         r"int8, fp8"):
        open_store(f"file://{tmp_path}?codec=zip", fingerprint=FP, num_layers=1, dtype=torch.float32,
                   kv_shape=KV_SHAPE)


def test_stats_shows_bytes_by_codec_and_the_ratio(tmp_path, capsys):
    for seed, codec in enumerate(["raw", "int8"]):
        keys, layers = make_chunks(32, 2, seed=seed)
        with open_test_store(f"file://{tmp_path}?codec={codec}", 2) as store:
            write_all(store, keys, layers)
    assert pd_kvstore([f"file://{tmp_path}", "stats"]) == 0
    out = capsys.readouterr().out
    found = re.search(r"by codec: int8 [\d.]+ GiB, raw [\d.]+ GiB; compression ratio ([\d.]+)x", out)
    assert found, out
    # 4 objects each, fp32 [2, 16, 2, 8]: raw 2048 + 64 bytes; int8 512 codes + 256 scale bytes + 64
    assert float(found.group(1)) == pytest.approx(8 * 2048 / (4 * 2112 + 4 * 832), abs=0.01)


@pytest.mark.parametrize("codec", ["raw", "lossless"])
def test_raw_and_lossless_hand_offs_are_token_identical_to_hf(codec, tiny_llama, tmp_path, caplog):
    prompts = [prompt(n, seed=7) for n in (17, 256, 300)]
    expected = hf_greedy(tiny_llama, prompts)
    producer, consumer = engine_pair(tiny_llama, f"file://{tmp_path}?codec={codec}")
    try:
        check_full_handoff(producer, consumer, prompts, expected, caplog)
        codecs = {m.group(1) for r in caplog.records if (m := re.search(r"Retrieved .*, codec: (\S+)$",
                                                                         r.getMessage()))}
        assert codecs == {codec}
    finally:
        producer.engine.shutdown()
        consumer.engine.shutdown()


def test_an_8bit_hand_off_loads_and_names_its_codec(tiny_llama, tmp_path, caplog):
    """Lossy: its output is measured (benchmarks/kv_codec_accuracy.py), not asserted; the load itself must
    happen (no fallback) and say what it moved."""
    prompts = [prompt(300, seed=8)]
    producer, consumer = engine_pair(tiny_llama, f"file://{tmp_path}?codec=int8")
    try:
        capture(caplog)
        producer.generate(prompts, PREFILL)
        out = consumer.generate(prompts, GREEDY)
        assert len(token_ids(out)[0]) == GREEDY.max_tokens and out[0].num_cached_tokens == 299
        loads = [r.getMessage() for r in caplog.records if "Retrieved" in r.getMessage()]
        assert len(loads) == 1 and loads[0].endswith("codec: int8")
        assert parse_line(loads[0]).values["need"] == 299  # pd-kv-hits reads the line as before
        assert not [r for r in caplog.records if "KV load failed" in r.getMessage()]
    finally:
        producer.engine.shutdown()
        consumer.engine.shutdown()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("codec", ["int8", "fp8"])
def test_the_compiled_decode_equals_the_torch_one_bit_for_bit(codec, dtype, monkeypatch):
    from pdserve.kvstore import kv_codecs

    assert kv_codecs._dequant_library() is not None  # noqa: SLF001 (gcc is part of this machine's setup)
    tensor = (torch.randn(2, 40, 3, 64, generator=torch.Generator().manual_seed(5)) * 3).to(dtype)
    payload = memoryview(kv_codecs.encode(tensor, codec))
    compiled = kv_codecs.decode(payload, codec, dtype, tuple(tensor.shape))
    monkeypatch.setattr(kv_codecs, "_dequant_library", lambda: None)  # the path without a library
    assert torch.equal(compiled, kv_codecs.decode(payload, codec, dtype, tuple(tensor.shape)))
