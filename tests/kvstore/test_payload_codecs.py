"""Stored KV codecs (kvstore/payload_codecs.py): chosen per store with ?codec=, named in every object's header.

Over a real directory, a real redis-server and a real Redis Cluster: what a store of each codec writes, a
store opened with no codec reads (a mixed store too); raw and lossless give back every bit pattern (all of
fp16's and bf16's, fp32's special values) and are token-identical to HF through a P/D pair; int8 and fp8
stay within the error bound docs/kv-codecs.md states, and reach it at rounding midpoints; a damaged scale is caught;
`pd-kvstore stats` counts bytes by codec and the ratio; the load line names the codec.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from pdserve.common.hashing import chunk_keys
from pdserve.connectors.kv_hits import parse_line
from pdserve.connectors.staging import ReadTarget
from pdserve.kvstore import CorruptObject, open_store, payload_codecs
from pdserve.kvstore.gate import NO_GATE
from pdserve.kvstore.cli import main as pd_kvstore
from tests.helpers.connector import (GREEDY, PREFILL, capture, check_full_handoff, engine_pair, hf_greedy, prompt,
                                     token_ids)
from tests.helpers.kvstore import FP, KV_SHAPE, make_chunks, open_test_store, write_all

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


# docs/kv-codecs.md, "Exactness": the 8-bit codecs' error bound, phrase by phrase as the doc writes it. The test
# below checks that the doc still says exactly this, so the doc's numbers and _error_bound's cannot drift apart.
DOC = Path(__file__).resolve().parents[2] / "docs" / "kv-codecs.md"
DOCUMENTED_BOUND = ["int8 `a/254`", "e4m3 `max(|x|/16, a/458752)`", "plus `a·2^-22` for the float32 arithmetic",
                    "half a unit in the last place of `y` in that dtype"]


def _error_bound(want: torch.Tensor, got: torch.Tensor, codec: str) -> torch.Tensor:
    """The documented bound on |got - want| for each value of an 8-bit codec (a: its group's absmax)."""
    a = want.double().abs().amax(-1, keepdim=True)
    return _half_step(want, codec) + a * 2.0 ** -22 + _half_ulp(got.double(), got.dtype)


def _half_step(want: torch.Tensor, codec: str) -> torch.Tensor:
    """Half a quantization step at each value of `want`: the codec's own part of the bound."""
    x = want.double()
    a = x.abs().amax(-1, keepdim=True)  # one group: (K or V, token, head)
    return a / 254 if codec == "int8" else torch.maximum(x.abs() / 16, a / 458752)


def _half_ulp(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half the spacing of `dtype` at each |y| (fp32: none, its rounding is the float32 allowance's)."""
    if dtype == torch.float32:
        return torch.zeros_like(y)
    info = torch.finfo(dtype)
    exponent = torch.frexp(y.abs().clamp(min=info.tiny)).exponent - 1  # |y|'s binade; subnormals: the smallest
    return torch.ldexp(torch.full_like(y, info.eps / 2), exponent.to(y.dtype))


def _close_enough(got: torch.Tensor, want: torch.Tensor, codec: str) -> None:
    if codec in ("raw", "lossless"):
        assert _bits(got).equal(_bits(want))
        return
    assert ((got.double() - want.double()).abs() <= _error_bound(want, got, codec)).all()


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns (NaN == NaN, -0 != +0): what "bit for bit" compares."""
    return tensor.contiguous().view({2: torch.int16, 4: torch.int32}[tensor.element_size()])


@pytest.mark.parametrize("kind", ["file", "redis", "cluster"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.slow  # seconds: outside make test-quick
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
@pytest.mark.slow  # seconds: outside make test-quick
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
    from pdserve.kvstore import payload_codecs

    assert payload_codecs._dequant_library() is not None  # noqa: SLF001 (gcc is part of this machine's setup)
    tensor = (torch.randn(2, 40, 3, 64, generator=torch.Generator().manual_seed(5)) * 3).to(dtype)
    payload = memoryview(payload_codecs.encode(tensor, codec))
    compiled = payload_codecs.decode(payload, codec, dtype, tuple(tensor.shape))
    monkeypatch.setattr(payload_codecs, "_dequant_library", lambda: None)  # the path without a library
    assert torch.equal(compiled, payload_codecs.decode(payload, codec, dtype, tuple(tensor.shape)))


def _every_pattern(dtype: torch.dtype) -> torch.Tensor:
    """[2, 2048, *KV_SHAPE] KV of 65,536 values: for a 16-bit dtype each of its bit patterns once (±0, every
    subnormal, ±inf, every NaN payload); for float32 its special values, then random bit patterns."""
    if dtype != torch.float32:
        return torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(dtype).view(2, -1, *KV_SHAPE)
    special = torch.tensor([0, -2**31, 1, 0x007FFFFF, -2**31 + 1, 0x00800000, 0x7F7FFFFF, 0x7F800000, -0x00800000,
                            0x7FC00000, 0x7F800001, 0x7FBFFFFF, -1, -0x00400000], dtype=torch.int32)
    noise = torch.randint(-2**31, 2**31, (2**16 - len(special),), dtype=torch.int64,
                          generator=torch.Generator().manual_seed(9)).to(torch.int32)
    return torch.cat([special, noise]).view(torch.float32).view(2, -1, *KV_SHAPE)


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("kind", ["file", "redis"])
@pytest.mark.parametrize("codec", ["raw", "lossless"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_raw_and_lossless_give_back_every_bit_pattern(dtype, codec, kind, compiled, tmp_path, request, monkeypatch):
    """Written through a store and read back by the per-object path and by the batched coded read (the C
    decode, or without a library the Python one): the same bits, NaN payloads and the sign of 0 included."""
    if not compiled:
        monkeypatch.setattr(payload_codecs, "_dequant_library", lambda: None)
    full = _every_pattern(dtype)
    lens = [1000, 1000, 48]  # a partial last chunk too
    keys = chunk_keys(FP, list(range(sum(lens))), lens[0])
    chunks = {key: part.contiguous() for key, part in zip(keys, full.split(lens, dim=1))}
    with open_test_store(_url(kind, tmp_path, request, codec), 1, dtype=dtype) as store:
        write_all(store, keys, [chunks])
        decoded, _, codecs = store.get_layer_decoded(0, keys)
        assert codecs == {codec}
        for got, want in zip(decoded, chunks.values()):
            assert _bits(got).equal(_bits(want))
        target = torch.zeros_like(full)
        store.get_layer_coded(0, keys, ReadTarget(target.view(-1).view(torch.uint8), target, lens).span_table(),
                              lens, NO_GATE)
        assert _bits(target).equal(_bits(full))
    if codec == "lossless":
        payload = memoryview(payload_codecs.encode(full, codec))
        assert _bits(payload_codecs.decode(payload, codec, dtype, tuple(full.shape))).equal(_bits(full))


def _with_absmax(values: list[float], absmax: float, dim: int = 64) -> torch.Tensor:
    """Groups of `dim` values [2, n, 1, dim]: each holds `absmax` (scale 1: the codes' own arithmetic is exact),
    then dim - 1 of `values` (zeros after the last)."""
    rows = []
    for start in range(0, len(values), dim - 1):
        piece = values[start:start + dim - 1]
        rows.append([absmax, *piece] + [0.0] * (dim - 1 - len(piece)))
    rows += [[0.0] * dim] * (len(rows) % 2)
    return torch.tensor(rows, dtype=torch.float64).view(2, -1, 1, dim)


def _midpoints(codec: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Values halfway between two codes (rounding to nearest even meets half a step there), with a = 127
    (int8) or 448 (e4m3), and whether each is in e4m3's subnormal range (below 2^-6 at scale 1)."""
    if codec == "int8":
        values = [k + 0.5 for k in range(127)]
    else:
        values = [(2 * k + 1) * 2.0 ** -10 for k in range(8)]  # subnormals: steps of 2^-9
        values += [(1 + (2 * k + 1) / 16) * 2.0 ** e for e in range(-6, 8) for k in range(8)]  # steps of 2^(e-3)
        values += [256 + 32 * k + 16 for k in range(6)]  # the top binade, up to 448
    values += [-v for v in values]
    kv = _with_absmax(values, 127.0 if codec == "int8" else 448.0)
    return kv, kv.abs() < 2.0 ** -6


def _spread(seed: int) -> torch.Tensor:
    """Random groups whose values span 24 binades (2^-20 .. 2^4 times a random group scale), so that every
    group has values in e4m3's subnormal range, next to plain normal KV."""
    gen = torch.Generator().manual_seed(seed)
    shape = (2, 40, 3, 64)
    magnitudes = torch.exp2(torch.rand(shape, generator=gen, dtype=torch.float64) * 24 - 20)
    signs = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0).double()
    group_scale = torch.exp2(torch.randint(-8, 8, (2, 40, 3, 1), generator=gen)).double()
    normal = torch.randn(shape, generator=gen, dtype=torch.float64) * 3
    return torch.cat([magnitudes * signs * group_scale, normal], dim=1)


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("codec", ["int8", "fp8"])
def test_8bit_codecs_stay_within_the_documented_bound_and_reach_it(codec, dtype, compiled, monkeypatch):
    """docs/kv-codecs.md states the bound, _error_bound is that bound: every value stays within it, on random
    groups and on rounding midpoints, where half a step is met (all of it in e4m3's subnormal range and in
    int8, 16/17 of |x|/16 in e4m3's normal range: the bound is tight, not a loose cap)."""
    text = " ".join(DOC.read_text().split())
    assert all(" ".join(phrase.split()) in text for phrase in DOCUMENTED_BOUND)
    if not compiled:
        monkeypatch.setattr(payload_codecs, "_dequant_library", lambda: None)
    else:
        assert payload_codecs._dequant_library() is not None  # noqa: SLF001 (gcc is part of this machine's setup)

    def round_trip(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        want = values.to(dtype)
        got = payload_codecs.decode(memoryview(payload_codecs.encode(want, codec)), codec, dtype, tuple(want.shape))
        error = (got.double() - want.double()).abs()
        return want, error, _error_bound(want, got, codec)

    for seed in range(3):
        want, error, bound = round_trip(_spread(seed))
        assert (error <= bound).all(), f"{(error - bound).max().item():.3g} over the bound"
    kv, subnormal = _midpoints(codec)
    want, error, bound = round_trip(kv)
    assert (error <= bound).all()
    reached = error / _half_step(want, codec)  # scale 1: no float32 nor dtype rounding, only the codes'
    midpoint = (want != 0) & (want.abs() != want.abs().amax(-1, keepdim=True))  # not the padding, not a
    if codec == "int8":
        assert reached[midpoint].min() == 1.0  # every midpoint is off by exactly a/254
    else:
        assert reached[midpoint & subnormal].min() == 1.0  # exactly a/458752
        assert reached[~subnormal].max() == pytest.approx(16 / 17)  # (1 + 1/16) * 2^e rounds to 2^e: |x|/17
