"""KV identity of LoRA adapters: the adapter's content fingerprint starts the prefix-cache and store hash
chains (common/hashing.py), so a store written under one adapter is never loaded for another or for the
base model (vLLM #44250), and the base model's keys stay what they were. The KV lines name the adapter."""
from __future__ import annotations

import logging
import random

import pytest

from pdserve.common.hashing import chain_seed, chunk_keys, digest, salt_tag
from pdserve.connectors.kv_hits import parse_line
from pdserve.serving import LLM, LoRARequest, SamplingParams
from tests.helpers.lora_adapters import adapter_set, hf_peft_greedy

_rng = random.Random(4)
PROMPT = [_rng.randrange(3, 259) for _ in range(300)]  # a whole 256-token chunk and a partial one
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
PREFILL = SamplingParams(max_tokens=1, temperature=0.0)
KW = dict(dtype="float32", kv_cache_memory="48MiB", chunk_size=256, enable_lora=True, max_lora_rank=64,
          max_loras=2)


def test_the_base_model_keeps_its_keys_and_each_adapter_gets_its_own():
    fp = "ab" * 16
    assert chain_seed(fp, "salt") == chain_seed(fp, "salt", None) == digest(b"pdserve-seed", fp.encode(), b"salt")
    seeds = {chain_seed(fp, None), chain_seed(fp, None, "1" * 32), chain_seed(fp, None, "2" * 32),
             chain_seed(fp, "salt", "1" * 32)}
    assert len(seeds) == 4
    assert chunk_keys(fp, [1, 2, 3], 2, None, "1" * 32) != chunk_keys(fp, [1, 2, 3], 2)
    assert salt_tag("salt") == digest(b"pdserve-salt", b"salt").hex()[:16]  # LMCache tags of the base model
    assert salt_tag(None) is None and salt_tag(None, "1" * 32) != salt_tag("salt", "1" * 32)


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    return adapter_set(tiny_llama, tmp_path_factory.mktemp("lora-kv"))


def test_a_store_written_under_one_adapter_is_no_hit_for_another(tiny_llama, adapters, tmp_path, caplog):
    url = f"file://{tmp_path / 'store'}"
    producer = LLM(str(tiny_llama), kv_store=url, kv_role="kv_producer", **KW)
    consumer = LLM(str(tiny_llama), kv_store=url, kv_role="kv_consumer", **KW)
    a, b = (LoRARequest(n, i, str(adapters[n])) for i, n in ((1, "a"), (2, "b")))
    same_name = LoRARequest("a", 1, str(adapters["a2"]))  # a's name and id, other weights
    try:
        with caplog.at_level(logging.INFO):
            producer.generate([PROMPT], PREFILL, lora_request=a)
            under_b = consumer.generate([PROMPT], GREEDY, lora_request=b)[0]
            under_a2 = consumer.generate([PROMPT], GREEDY, lora_request=same_name)[0]
            base = consumer.generate([PROMPT], GREEDY)[0]
            under_a = consumer.generate([PROMPT], GREEDY, lora_request=a)[0]
        events = [e for e in map(parse_line, caplog.messages) if e is not None and e.kind == "lookup"]
        assert [e.values["hit"] for e in events] == [0, 0, 0, 300]  # only a's own KV is found
        assert (under_b.num_cached_tokens, under_a2.num_cached_tokens, base.num_cached_tokens) == (0, 0, 0)
        assert under_a.num_cached_tokens == 299  # the last token is always computed
        want = {n: hf_peft_greedy(tiny_llama, adapters[n] if n else None, [PROMPT], 8)[0]
                for n in ("a", "b", "a2", None)}
        got = {"b": under_b, "a2": under_a2, None: base, "a": under_a}
        assert {n: o.outputs[0].token_ids for n, o in got.items()} == want
        stored = [m for m in caplog.messages if "Stored" in m]
        assert stored and all(m.endswith(f"LoRA adapter: {producer.engine.model_runner.lora.load(a).label}")
                              for m in stored)
        assert any("Retrieved" in m and "LoRA adapter: a (" in m for m in caplog.messages)
    finally:
        producer.engine.shutdown()
        consumer.engine.shutdown()
