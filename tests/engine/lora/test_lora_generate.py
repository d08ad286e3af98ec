"""LoRA through the offline LLM, against HF + PEFT greedy on the same files (fp32, token for token).

One adapter, a batch mixing adapters with the base model, chunked prefill, the max_loras bound, the LRU of
max_cpu_loras, and the KV identity: KV computed under one adapter is never a prefix-cache hit for another
adapter or for the base model, however the adapters are named (docs/lora.md)."""
from __future__ import annotations

import random

import pytest

from pdserve import LLM, LoRARequest, SamplingParams
from tests.helpers.lora_adapters import adapter_set, hf_peft_greedy

GREEDY = SamplingParams(max_tokens=10, temperature=0.0)
_rng = random.Random(38)
PROMPTS = [[_rng.randrange(3, 259) for _ in range(n)] for n in (1, 16, 37, 100)]


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    return adapter_set(tiny_llama, tmp_path_factory.mktemp("lora"))


@pytest.fixture(scope="module")
def refs(tiny_llama, adapters):
    """HF + PEFT greedy of PROMPTS under each adapter and the base model (None)."""
    out = {name: hf_peft_greedy(tiny_llama, path, PROMPTS, GREEDY.max_tokens) for name, path in adapters.items()}
    out[None] = hf_peft_greedy(tiny_llama, None, PROMPTS, GREEDY.max_tokens)
    return out


def lora(adapters, name: str, int_id: int) -> LoRARequest:
    return LoRARequest(name, int_id, str(adapters[name]))


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32", kv_cache_memory="64MiB", enable_lora=True, max_loras=3,
               max_lora_rank=64)


def test_the_adapters_change_the_output(refs):
    """Otherwise the comparisons below would prove nothing."""
    for name in ("a", "b", "qv", "a2"):
        assert refs[name] != refs[None]
    assert refs["a"] != refs["a2"]


def test_one_adapter_matches_hf_peft(llm, adapters, refs):
    llm.engine.reset_prefix_cache()
    assert tokens(llm.generate(PROMPTS, GREEDY, lora_request=lora(adapters, "a", 1))) == refs["a"]
    assert tokens(llm.generate(PROMPTS, GREEDY, lora_request=lora(adapters, "b", 2))) == refs["b"]


def test_a_batch_mixing_adapters_and_the_base_model_matches_hf_peft(llm, adapters, refs):
    llm.engine.reset_prefix_cache()
    names = ["a", "qv", None, "b"]
    batch = [p for p in PROMPTS for _ in names]
    loras = [None if n is None else lora(adapters, n, i + 1) for _ in PROMPTS for i, n in enumerate(names)]
    got = tokens(llm.generate(batch, GREEDY, lora_request=loras))
    want = [refs[n][k] for k in range(len(PROMPTS)) for n in names]
    assert got == want


def test_chunked_prefill_under_an_adapter_matches_hf_peft(tiny_llama, adapters, refs):
    chunked = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="64MiB", enable_lora=True, max_lora_rank=64,
                  max_num_batched_tokens=48, long_prefill_token_threshold=20)
    assert tokens(chunked.generate(PROMPTS, GREEDY, lora_request=lora(adapters, "qv", 3))) == refs["qv"]


def test_max_loras_keeps_other_adapters_waiting_without_changing_outputs(tiny_llama, adapters, refs):
    one = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="64MiB", enable_lora=True, max_loras=1,
              max_cpu_loras=1, max_lora_rank=64)
    steps = []
    prepare = one.engine.model_runner.lora.prepare

    def spy(inputs):
        steps.append({id(r.lora) for r in inputs.requests if r.lora is not None})
        prepare(inputs)

    one.engine.model_runner.lora.prepare = spy
    loras = [lora(adapters, "a", 1), lora(adapters, "b", 2), None, lora(adapters, "a", 1)]
    got = tokens(one.generate(PROMPTS, GREEDY, lora_request=loras))
    assert got == [refs["a"][0], refs["b"][1], refs[None][2], refs["a"][3]]
    # "a" was dropped from memory when "b" came (max_cpu_loras=1) and read again for the last prompt
    assert max(len(s) for s in steps) == 1 and len(set().union(*steps)) == 3
    assert one.list_loras() == {1}


def test_kv_of_one_adapter_is_no_hit_for_another_or_for_the_base_model(llm, adapters, refs):
    llm.engine.reset_prefix_cache()
    prompt = [PROMPTS[3]]
    first = llm.generate(prompt, GREEDY, lora_request=lora(adapters, "a", 1))[0]
    assert first.num_cached_tokens == 0 and first.outputs[0].token_ids == refs["a"][3]
    under_b = llm.generate(prompt, GREEDY, lora_request=lora(adapters, "b", 2))[0]
    assert under_b.num_cached_tokens == 0 and under_b.outputs[0].token_ids == refs["b"][3]
    base = llm.generate(prompt, GREEDY)[0]
    assert base.num_cached_tokens == 0 and base.outputs[0].token_ids == refs[None][3]
    again = llm.generate(prompt, GREEDY, lora_request=lora(adapters, "a", 1))[0]
    assert again.num_cached_tokens == 96 and again.outputs[0].token_ids == refs["a"][3]  # its own KV: a hit


def test_a_reused_name_with_other_weights_gets_other_keys(llm, adapters, refs):
    """vLLM #44250's failure: the same name (and id) on other weights must not find the first one's KV."""
    llm.engine.reset_prefix_cache()
    prompt = [PROMPTS[3]]
    first = llm.generate(prompt, GREEDY, lora_request=LoRARequest("same", 7, str(adapters["a"])))[0]
    second = llm.generate(prompt, GREEDY, lora_request=LoRARequest("same", 7, str(adapters["a2"])))[0]
    assert second.num_cached_tokens == 0
    assert (first.outputs[0].token_ids, second.outputs[0].token_ids) == (refs["a"][3], refs["a2"][3])


def test_lora_requests_need_enable_lora_and_a_servable_adapter(tiny_llama, adapters, refs, llm, tmp_path):
    plain = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="64MiB")
    with pytest.raises(ValueError, match="enable_lora"):
        plain.generate(PROMPTS[:1], GREEDY, lora_request=lora(adapters, "a", 1))
    small = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="64MiB", enable_lora=True, max_lora_rank=16)
    with pytest.raises(ValueError, match="rank 64, above max_lora_rank=16"):
        small.generate(PROMPTS[:1], GREEDY, lora_request=lora(adapters, "b", 2))
    with pytest.raises(ValueError, match="does not exist"):
        llm.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest("gone", 9, str(tmp_path / "nope")))
    with pytest.raises(ValueError, match="got 1 lora_request for 2 prompts"):
        llm.generate(PROMPTS[:2], GREEDY, lora_request=[None])
    with pytest.raises(ValueError, match="tensor or pipeline parallelism"):
        LLM(str(tiny_llama), enable_lora=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LLM(str(tiny_llama), enable_lora=True, max_loras=2, max_cpu_loras=1)
    assert tokens(llm.generate(PROMPTS[:1], GREEDY)) == [refs[None][0]]  # a refused adapter disturbed nothing
