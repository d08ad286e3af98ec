"""Beam search (use_beam_search, n = width, length_penalty) on the engine's forked sequences: the n choices are
HF generate(num_beams=n, num_return_sequences=n)'s sequences, best first, token for token (fp32, tiny model);
what it cannot honour is refused; every beam's KV blocks come back, finished or aborted."""
from __future__ import annotations

import pytest
import torch

from pdserve.serving import LLM, SamplingParams
from tests.helpers.prompts import random_prompt
from tests.helpers.oracles import hf_beams

CASES = [(2, 1.0, 6), (3, 0.5, 10), (4, 2.0, 12), (1, 1.0, 5)]  # (width, length_penalty, max_tokens)
PROMPTS = [random_prompt(5 + 9 * i, seed=400 + i) for i in range(4)]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32", kv_cache_memory="16MiB")


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()


@pytest.mark.parametrize("width,length_penalty,max_tokens", CASES)
@pytest.mark.slow  # seconds: outside make test-quick
def test_beams_equal_hf(llm, hf_model, width, length_penalty, max_tokens):
    params = SamplingParams(n=width, use_beam_search=True, length_penalty=length_penalty, max_tokens=max_tokens)
    outs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs):
        assert [c.token_ids for c in out.outputs] == hf_beams(hf_model, prompt, width, length_penalty, max_tokens)
        assert [c.index for c in out.outputs] == list(range(width))
        decode = llm.engine.tokenizer.decode
        assert all(c.text == decode(c.token_ids, skip_special_tokens=True) and c.finish_reason == "length"
                   for c in out.outputs)
    kv = llm.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks and not llm.engine.has_unfinished_requests()


def test_beams_share_the_prompt_and_an_abort_frees_every_beam(llm):
    engine, kv = llm.engine, llm.engine.kv_cache_manager
    before = engine.get_stats().num_prompt_tokens_computed
    prompt = random_prompt(70, seed=5)
    engine.add_request("beams", prompt, SamplingParams(n=4, use_beam_search=True, max_tokens=50, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine.get_stats().num_prompt_tokens_computed - before == len(prompt)  # once, not once per beam
    assert len(engine.scheduler.running) == 4 and kv.num_free_blocks < kv.num_blocks
    engine.abort_request("beams")
    assert kv.num_free_blocks == kv.num_blocks and not engine.has_request("beams")
    assert not engine.scheduler.running and not engine.scheduler.requests


@pytest.mark.parametrize("extra", [dict(logprobs=True), dict(stop=["x"]), dict(min_tokens=2), dict(logit_bias={5: 1}),
                                   dict(presence_penalty=0.5), dict(prompt_logprobs=0), dict(bad_words=["ab"])])
def test_what_beam_search_cannot_honour_is_refused(extra):
    with pytest.raises(ValueError, match=f"{next(iter(extra))} is not supported with use_beam_search"):
        SamplingParams(n=2, use_beam_search=True, **extra)


@pytest.mark.parametrize("length_penalty", [1e6, -1e6, 2000.0])
def test_a_length_penalty_at_its_bounds_answers_instead_of_failing_the_step(llm, length_penalty):
    """length ** length_penalty leaves the float range long before +-1e6 (3 ** 2000 already does): the score
    saturates (to 0 or -inf) instead of raising inside the engine step every request of the batch shares."""
    out = llm.generate([PROMPTS[0]], SamplingParams(n=2, use_beam_search=True, length_penalty=length_penalty,
                                                    max_tokens=4, ignore_eos=True))[0]
    assert [len(c.token_ids) for c in out.outputs] == [4, 4]
