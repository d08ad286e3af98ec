"""Producer -> kvstore -> consumer hand-off inside one process, over a real directory and a real redis-server.

Engines are module-scoped (they are the expensive part); every test uses prompts of its own seed
so the consumer's local prefix cache never carries one test's state into another.
"""
from __future__ import annotations

import shutil
import signal
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pdserve.engine.request import Request
from pdserve.serving import LLM
from tests.helpers.connector import (ENGINE_KW, FALLBACK_RE, GREEDY, LENGTHS, LOOKUP_RE, PARTIAL_CASES, PREFILL,
                                     SAVE_RE, broken_at_load_start, capture, check_full_handoff, check_partial_load,
                                     check_salts_never_share, engine_pair, hf_greedy,
                                     lines, mono_engine, prompt, prompt_tokens_computed, token_ids)
from tests.helpers.timing import HANG_S

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kvstore")


@pytest.fixture(scope="module")
def file_pair(tiny_llama, store_dir):
    producer, consumer = engine_pair(tiny_llama, f"file://{store_dir}")
    yield producer, consumer
    producer.engine.shutdown()
    consumer.engine.shutdown()


@pytest.fixture(scope="module")
def redis_pair(tiny_llama, redis_module):
    producer, consumer = engine_pair(tiny_llama, redis_module.url)
    yield producer, consumer
    producer.engine.shutdown()
    consumer.engine.shutdown()


@pytest.fixture(scope="module")
def mono(tiny_llama) -> LLM:
    return mono_engine(tiny_llama)


@pytest.fixture(scope="module")
def all_lengths(tiny_llama, mono):
    prompts = [prompt(n, seed=1) for n in LENGTHS]
    expected = hf_greedy(tiny_llama, prompts)
    assert token_ids(mono.generate(prompts, GREEDY)) == expected
    return prompts, expected


def _chunk_file(root: Path, key: str, layer: int) -> Path:
    (path,) = root.rglob(f"{key}/{layer}.kv")
    return path


@pytest.mark.parametrize("pair", ["file_pair", "redis_pair"])
@pytest.mark.slow  # seconds: outside make test-quick
def test_handoff_is_exact_and_computes_one_prompt_token(request, pair, all_lengths, caplog):
    prompts, expected = all_lengths
    check_full_handoff(*request.getfixturevalue(pair), prompts, expected, caplog)


@pytest.mark.parametrize("case,want", PARTIAL_CASES)
@pytest.mark.slow  # seconds: outside make test-quick
def test_local_prefix_loads_only_the_rest(file_pair, mono, case, want, caplog):
    check_partial_load(*file_pair, mono, case, want, caplog, seed=10 + sum(case))


@pytest.mark.slow  # seconds: outside make test-quick
def test_prompt_extension_writes_only_new_chunks(file_pair, mono, caplog):
    producer, consumer = file_pair
    store = producer.engine.connector.store
    fp = producer.engine.connector.fingerprint
    base = prompt(300, seed=20)
    extended = base + prompt(400, seed=21)

    def chunks() -> int:
        return store.inventory()[fp].chunks

    before = chunks()
    producer.generate([base], PREFILL)
    assert chunks() - before == 2  # one full chunk + the partial [256, 300)
    capture(caplog)
    producer.generate([extended], PREFILL)
    assert chunks() - before == 4  # chunk 0 reused; [256, 512) and [512, 700) are new
    assert [s[1:] for s in lines(caplog, SAVE_RE)] == [(444, 256, 700, 700, 256)]
    caplog.clear()
    producer.generate([extended], PREFILL)  # everything present: nothing written again
    assert chunks() - before == 4 and lines(caplog, SAVE_RE) == []
    out = consumer.generate([extended], GREEDY)
    assert token_ids(out) == token_ids(mono.generate([extended], GREEDY))
    assert out[0].num_cached_tokens == 699


@pytest.mark.slow  # seconds: outside make test-quick
def test_chunked_prefill_saves_every_chunk_once(tiny_llama, store_dir, file_pair, mono, caplog):
    _, consumer = file_pair
    producer = LLM(str(tiny_llama), kv_store=f"file://{store_dir}", kv_role="producer", max_num_batched_tokens=96,
                   **ENGINE_KW)
    full = prompt(1000, seed=30)
    capture(caplog)
    producer.generate([full], PREFILL)
    producer.engine.shutdown()
    assert [s[2:4] for s in lines(caplog, SAVE_RE)] == [(0, 256), (256, 512), (512, 768), (768, 1000)]
    before = prompt_tokens_computed(consumer)
    out = consumer.generate([full], GREEDY)
    assert token_ids(out) == token_ids(mono.generate([full], GREEDY))
    assert prompt_tokens_computed(consumer) - before == 1


def _fault_roundtrip(producer, consumer, mono, full, caplog, break_store) -> list[tuple]:
    """Prefill, break the store, decode: the output must stay exact; returns the fallback lines."""
    producer.generate([full], PREFILL)
    break_store()
    capture(caplog)
    failed_before = consumer.engine.get_stats().num_failed_loads
    out = consumer.generate([full], GREEDY)
    assert token_ids(out) == token_ids(mono.generate([full], GREEDY))
    found = lines(caplog, FALLBACK_RE)
    if found:
        assert consumer.engine.get_stats().num_failed_loads - failed_before <= len(found)
    return found


def test_corrupt_object_is_recomputed(file_pair, store_dir, mono, caplog):
    producer, consumer = file_pair
    full = prompt(600, seed=40)
    key = producer.engine.connector.keys_for(full, None)[0]

    def corrupt():
        path = _chunk_file(store_dir, key, 2)
        data = bytearray(path.read_bytes())
        data[-5] ^= 0xFF
        path.write_bytes(bytes(data))

    found = _fault_roundtrip(producer, consumer, mono, full, caplog, corrupt)
    assert [(reason, n) for _, reason, n in found] == [("corrupt", 599)]
    assert consumer.engine.connector.metrics.value("pdserve_kv_fallbacks_total", reason="corrupt") >= 1


@pytest.mark.slow  # seconds: outside make test-quick
def test_chunk_with_missing_layer_is_recomputed(file_pair, store_dir, mono, caplog):
    producer, consumer = file_pair
    full = prompt(600, seed=41)
    key = producer.engine.connector.keys_for(full, None)[1]
    found = _fault_roundtrip(producer, consumer, mono, full, caplog, lambda: _chunk_file(store_dir, key, 3).unlink())
    assert [(reason, n) for _, reason, n in found] == [("missing", 599)]


@pytest.mark.slow  # seconds: outside make test-quick
def test_store_deleted_between_prefill_and_decode(file_pair, store_dir, mono, caplog):
    producer, consumer = file_pair
    # deleted before decode starts: the lookup reports the outage and the consumer computes the prompt
    full = prompt(300, seed=42)
    found = _fault_roundtrip(producer, consumer, mono, full, caplog, lambda: shutil.rmtree(store_dir))
    assert [(reason, n) for _, reason, n in found] == [("unavailable", 299)]
    assert [lk[3:] for lk in lines(caplog, LOOKUP_RE)] == [(0, 0)]
    store_dir.mkdir()
    # deleted after the lookup, while the load is starting: a fallback line and a recompute
    caplog.clear()
    full = prompt(300, seed=43)
    try:
        with broken_at_load_start(consumer.engine.connector, lambda: shutil.rmtree(store_dir)):
            found = _fault_roundtrip(producer, consumer, mono, full, caplog, lambda: None)
    finally:
        store_dir.mkdir(exist_ok=True)
    assert [(reason, n) for _, reason, n in found] == [("missing", 299)]


@pytest.mark.slow  # seconds: outside make test-quick
def test_redis_stopped_between_prefill_and_decode(redis_pair, redis_module, mono, caplog):
    producer, consumer = redis_pair
    full = prompt(300, seed=44)
    try:
        found = _fault_roundtrip(producer, consumer, mono, full, caplog, redis_module.stop)
    finally:
        redis_module.start()
    assert [(reason, n) for _, reason, n in found] == [("unavailable", 299)]
    # the store works again once redis is back
    full = prompt(300, seed=45)
    producer.generate([full], PREFILL)
    assert consumer.generate([full], GREEDY)[0].num_cached_tokens == 299


@pytest.mark.slow
def test_frozen_redis_hits_the_load_deadline(redis_pair, redis_module, mono, caplog):
    """Redis stops answering after the lookup: the load gives up at load_timeout_s and recomputes."""
    producer, consumer = redis_pair
    full = prompt(300, seed=46)
    try:
        with broken_at_load_start(consumer.engine.connector, lambda: redis_module.proc.send_signal(signal.SIGSTOP)):
            found = _fault_roundtrip(producer, consumer, mono, full, caplog, lambda: None)
    finally:
        redis_module.proc.send_signal(signal.SIGCONT)
    assert [(reason, n) for _, reason, n in found] == [("timeout", 299)]


@pytest.mark.slow  # seconds: outside make test-quick
def test_cache_salts_never_share_chunks(file_pair, mono, caplog):
    check_salts_never_share(*file_pair, mono, caplog, seed=50)


@pytest.mark.slow  # seconds: outside make test-quick
def test_two_models_never_share_chunks(file_pair, tiny_qwen2, store_dir, caplog):
    producer, _ = file_pair
    full = prompt(300, seed=51)
    producer.generate([full], PREFILL)
    qwen = LLM(str(tiny_qwen2), kv_store=f"file://{store_dir}", kv_role="consumer", **ENGINE_KW)
    capture(caplog)
    out = qwen.generate([full], GREEDY)
    qwen.engine.shutdown()
    assert [lk[3] for lk in lines(caplog, LOOKUP_RE)] == [0]
    assert token_ids(out) == hf_greedy(tiny_qwen2, [full])


def test_metrics_count_the_handoff_and_export_through_a_server_registry(file_pair):
    producer, consumer = file_pair
    saved, loaded = producer.engine.connector.metrics, consumer.engine.connector.metrics
    before = {name: m.value(name) for m, name in [(saved, "pdserve_kv_saved_tokens_total"),
                                                  (saved, "pdserve_kv_saved_chunks_total"),
                                                  (loaded, "pdserve_kv_hit_tokens_total"),
                                                  (loaded, "pdserve_kv_loaded_tokens_total")]}
    full = prompt(300, seed=60)
    producer.generate([full], PREFILL)
    consumer.generate([full], GREEDY)
    assert saved.value("pdserve_kv_saved_tokens_total") - before["pdserve_kv_saved_tokens_total"] == 300
    assert saved.value("pdserve_kv_saved_chunks_total") - before["pdserve_kv_saved_chunks_total"] == 2
    assert loaded.value("pdserve_kv_hit_tokens_total") - before["pdserve_kv_hit_tokens_total"] == 300
    assert loaded.value("pdserve_kv_loaded_tokens_total") - before["pdserve_kv_loaded_tokens_total"] == 299
    registry = CollectorRegistry()  # what a node server does with its engine's connector
    registry.register(loaded)
    text = generate_latest(registry).decode()
    assert f"pdserve_kv_loaded_tokens_total {loaded.value('pdserve_kv_loaded_tokens_total')}" in text
    assert "pdserve_kv_load_seconds_bucket" in text and "pdserve_kv_load_bytes_total" in text


def test_retried_admission_does_not_ask_the_store_again(file_pair, caplog):
    """The lookup runs in the background (None until it answers); a request that then finds no free
    blocks is retried every step: one lookup and one log line, not one per step."""
    producer, consumer = file_pair
    full = prompt(300, seed=60)
    producer.generate([full], PREFILL)
    connector = consumer.engine.connector
    request = Request("retry-1", full, GREEDY)
    capture(caplog)
    before = connector.store.stats().lookups
    deadline = time.monotonic() + HANG_S  # (milliseconds from a local file store)
    while (answer := connector.get_num_new_matched_tokens(request, 0)) == (None, False):
        assert time.monotonic() < deadline, "the background lookup never answered"
        time.sleep(0.001)
    assert answer == (299, True)  # 299 tokens to load, in the background if the scheduler wants
    assert connector.get_num_new_matched_tokens(request, 0) == (299, True)
    assert connector.store.stats().lookups - before == 1
    assert len(lines(caplog, LOOKUP_RE)) == 1
    connector.request_finished(request, [])
