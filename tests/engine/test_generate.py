"""LLM.generate end to end against Hugging Face `generate` on the same weights (fp32, greedy).

Every scheduling regime — plain, prefix-cached, chunked, preempted — must produce exactly
HF's tokens; the engine's counters prove the regime really happened.
"""
from __future__ import annotations

import pytest

from pdserve.serving import LLM, SamplingParams
from tests.helpers.model_steps import BLOCK_BYTES_TINY
from tests.helpers.oracles import hf_greedy
from tests.helpers.prompts import random_prompt

LENGTHS = [1, 15, 16, 17, 100, 255, 256, 257, 600]
MAX_TOKENS = 12


PROMPTS = [random_prompt(n, seed=n) for n in LENGTHS]
# Wave 2 of the prefix-caching test: the same prompts again plus new suffixes on shared prefixes.
WAVE2 = PROMPTS + [PROMPTS[-1][:300] + random_prompt(20, 1), PROMPTS[7][:200] + random_prompt(7, 2)]


@pytest.fixture(scope="module")
def llama_refs(tiny_llama):
    return hf_greedy(tiny_llama, WAVE2)


@pytest.fixture(scope="module")
def qwen2_refs(tiny_qwen2):
    return hf_greedy(tiny_qwen2, PROMPTS)


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    outs = llm.generate(prompts, params)
    assert [o.prompt_token_ids for o in outs] == prompts
    return [o.token_ids for o in outs]


@pytest.mark.slow  # seconds: outside make test-quick
def test_defaults_match_hf(tiny_llama, llama_refs):
    llm = LLM(str(tiny_llama), dtype="float32")
    assert generate(llm, PROMPTS) == llama_refs[:len(PROMPTS)]
    stats = llm.engine.get_stats()
    assert stats.num_prompt_tokens_computed == sum(LENGTHS) and stats.num_preemptions == 0


def test_prefix_caching_two_waves_match_hf(tiny_llama, llama_refs):
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="64MiB")
    assert generate(llm, PROMPTS) == llama_refs[:len(PROMPTS)]
    before = llm.engine.get_stats()
    outs = llm.generate(WAVE2, GREEDY)
    assert [o.token_ids for o in outs] == llama_refs
    # a repeated prompt hits all its full blocks except the one holding its last token
    assert [o.num_cached_tokens for o in outs[:len(PROMPTS)]] == [(n - 1) // 16 * 16 for n in LENGTHS]
    assert outs[-2].num_cached_tokens == 288 and outs[-1].num_cached_tokens == 192
    after = llm.engine.get_stats()
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    assert hits == sum(o.num_cached_tokens for o in outs) > 0
    assert after.num_prompt_tokens_computed - before.num_prompt_tokens_computed == sum(map(len, WAVE2)) - hits


def test_chunked_prefill_matches_hf(tiny_llama, llama_refs):
    llm = LLM(str(tiny_llama), dtype="float32", max_num_batched_tokens=64, long_prefill_token_threshold=40,
              enable_prefix_caching=False, kv_cache_memory="64MiB")
    assert generate(llm, PROMPTS) == llama_refs[:len(PROMPTS)]
    assert llm.engine.get_stats().num_prompt_tokens_computed == sum(LENGTHS)


def test_preemption_matches_hf(tiny_llama, llama_refs):
    # Chunked admission lets running prompts outgrow the pool, as in production.
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=48 * BLOCK_BYTES_TINY, max_num_batched_tokens=64)
    assert llm.engine.kv_cache_manager.num_blocks == 48
    assert generate(llm, PROMPTS) == llama_refs[:len(PROMPTS)]
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0 and stats.num_free_blocks == 48


@pytest.mark.slow  # seconds: outside make test-quick
def test_qwen2_matches_hf_plain_and_chunked(tiny_qwen2, qwen2_refs):
    assert generate(LLM(str(tiny_qwen2), dtype="float32", kv_cache_memory="64MiB"), PROMPTS) == qwen2_refs
    chunked = LLM(str(tiny_qwen2), dtype="float32", max_num_batched_tokens=64,
                  kv_cache_memory=48 * BLOCK_BYTES_TINY)
    assert generate(chunked, PROMPTS) == qwen2_refs
    assert chunked.engine.get_stats().num_preemptions > 0


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32", kv_cache_memory="64MiB")


def test_temperature_zero_is_greedy_whatever_top_k_top_p(llm, llama_refs):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, top_k=3, top_p=0.5, seed=7)
    assert generate(llm, PROMPTS[4:6], params) == llama_refs[4:6]


def test_running_outputs_carry_the_delta_and_the_final_one_everything(llm):
    """A step's output holds only that step's tokens and text while the request runs (no O(n) copy
    per step); the final output holds the whole output, equal to the deltas joined."""
    engine = llm.engine
    engine.add_request("deltas", PROMPTS[3], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert len(outs) == 12 and outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert all(o.token_ids == [] and o.text == "" for o in outs[:-1])
    assert outs[-1].token_ids == [t for o in outs for t in o.new_token_ids]
    assert outs[-1].text == "".join(o.new_text for o in outs)


@pytest.mark.slow  # seconds: outside make test-quick
def test_seeded_sampling_is_reproducible(llm):
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=1234)
    alone = llm.generate([PROMPTS[4]], params)[0].token_ids
    batched = llm.generate([PROMPTS[6], PROMPTS[4], PROMPTS[2]],
                           [SamplingParams(max_tokens=5, temperature=1.0), params, GREEDY])[1].token_ids
    assert alone == batched
    other = llm.generate([PROMPTS[4]], SamplingParams(max_tokens=16, temperature=1.0, seed=99))[0].token_ids
    assert other != alone


def test_text_prompts_stop_strings_and_stop_tokens(llm):
    ignore = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    full = llm.generate("The quick brown fox", ignore)[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 24
    assert full.prompt_token_ids == llm.engine.tokenizer.encode("The quick brown fox", add_special_tokens=False)
    printable = [i for i, c in enumerate(full.text) if c.isprintable() and c != "\ufffd" and i > 2]
    stop = full.text[printable[0]]
    cut = llm.generate("The quick brown fox", SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                             stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[:full.text.index(stop)] and stop not in cut.text
    assert cut.token_ids == full.token_ids[:len(cut.token_ids)] and len(cut.token_ids) < 24
    by_id = llm.generate("The quick brown fox", SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                               stop_token_ids=[full.token_ids[5]]))[0]
    assert by_id.finish_reason == "stop" and by_id.token_ids == full.token_ids[:full.token_ids.index(
        full.token_ids[5]) + 1]


def test_bad_configuration_is_a_clear_error(tiny_llama):
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        LLM(str(tiny_llama), block_size=12)
    with pytest.raises(ValueError, match="cannot parse a byte size"):
        LLM(str(tiny_llama), kv_cache_memory="lots")
    with pytest.raises(ValueError, match="less than one block"):
        LLM(str(tiny_llama), kv_cache_memory=1000)
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        LLM(str(tiny_llama), max_num_seqs=0)
    with pytest.raises(TypeError, match="unknown engine option 'max_seqs'"):
        LLM(str(tiny_llama), max_seqs=4)
    with pytest.raises(ValueError, match="cannot read a Hugging Face config"):
        LLM("/nonexistent/model")


def test_bad_sampling_params_and_prompts_are_clear_errors(llm):
    for kwargs, message in [({"max_tokens": 0}, "max_tokens must be"), ({"temperature": -1}, "temperature must"),
                            ({"top_p": 0.0}, "top_p must"), ({"top_k": -2}, "top_k must"),
                            ({"stop": [""]}, "stop must"), ({"stop_token_ids": [-1]}, "stop_token_ids must")]:
        with pytest.raises(ValueError, match=message):
            SamplingParams(**kwargs)
    engine = llm.engine
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("e", [], GREEDY)
    with pytest.raises(ValueError, match=r"integers in \[0, 384\)"):
        engine.add_request("v", [5, 384], GREEDY)
    with pytest.raises(ValueError, match="more than max_model_len"):
        engine.add_request("l", [5] * (engine.max_model_len + 1), GREEDY)
    with pytest.raises(ValueError, match="2 sampling_params for 3 prompts"):
        llm.generate([[5], [6], [7]], [GREEDY, GREEDY])
    assert not engine.has_unfinished_requests()
    # a bad prompt in the middle of a batch leaves nothing behind
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([[5, 6], [], [7]], GREEDY)
    assert not engine.has_unfinished_requests()
