"""n > 1: the choices share the prompt's KV (computed once) and each samples its own seeded stream."""
from __future__ import annotations

import logging

import pytest

from pdserve.serving import LLM, SamplingParams
from tests.helpers.model_steps import BLOCK_BYTES_TINY
from tests.helpers.oracles import hf_greedy
from tests.helpers.prompts import random_prompt

# Around block boundaries: the partial last block is copied per choice, full blocks are shared.
PROMPTS = [random_prompt(n, seed=100 + n) for n in (1, 15, 16, 17, 40)]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32", kv_cache_memory="16MiB")


def computed(llm: LLM) -> int:
    return llm.engine.get_stats().num_prompt_tokens_computed


def test_each_choice_is_its_own_seeded_stream_and_the_prompt_is_computed_once(llm):
    params = SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
    before = computed(llm)
    results = llm.generate(PROMPTS, params)
    assert computed(llm) - before == sum(map(len, PROMPTS))  # not 3x
    assert [r.prompt_token_ids for r in results] == PROMPTS  # vLLM's shape: one result per prompt
    assert [[o.index for o in r.outputs] for r in results] == [[0, 1, 2]] * len(PROMPTS)
    for p, trio in zip(PROMPTS, (r.outputs for r in results)):
        assert len({tuple(o.token_ids) for o in trio}) == 3
        for o in trio:  # choice i == a lone request seeded seed + i: the forked KV is exact
            alone = llm.generate([p], SamplingParams(max_tokens=10, temperature=1.0, seed=7 + o.index,
                                                     ignore_eos=True))[0]
            assert o.token_ids == alone.token_ids and o.text == alone.text
    stats = llm.engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks and not llm.engine.has_unfinished_requests()


def test_greedy_choices_all_match_hf(tiny_llama, llm):
    refs = hf_greedy(tiny_llama, PROMPTS[2:4], 8)
    results = llm.generate(PROMPTS[2:4], SamplingParams(n=2, max_tokens=8, temperature=0.0))
    assert [[o.token_ids for o in r.outputs] for r in results] == [[refs[0], refs[0]], [refs[1], refs[1]]]


def test_single_token_choices_and_a_pool_too_small_to_fork(tiny_llama, caplog):
    # 5 blocks: a 40-token prompt takes 3, the first two forks take one copy each, the third waits
    # (as if preempted) and is recomputed once there is room. Every choice is still exact.
    caplog.set_level(logging.INFO, logger="pdserve.engine")
    small = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=5 * BLOCK_BYTES_TINY)
    params = SamplingParams(n=4, max_tokens=3, temperature=1.0, seed=11, ignore_eos=True)
    outs = small.generate([PROMPTS[4]], params)[0].outputs
    singles = [small.generate([PROMPTS[4]], SamplingParams(max_tokens=3, temperature=1.0, seed=11 + i,
                                                           ignore_eos=True))[0].token_ids for i in range(4)]
    assert [o.token_ids for o in outs] == singles
    assert "Reqid: 3_gen-0, choice 3 waits for room" in caplog.text
    firsts = small.generate([PROMPTS[1]], SamplingParams(n=3, max_tokens=1, temperature=1.0, seed=5))[0].outputs
    assert [len(o.token_ids) for o in firsts] == [1, 1, 1]
    stats = small.engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_abort_ends_every_choice(llm):
    engine = llm.engine
    engine.add_request("abort-me", PROMPTS[4], SamplingParams(n=3, max_tokens=50, ignore_eos=True))
    engine.step()  # choice 0 prefills, the others fork
    assert engine.has_request("abort-me")
    outs = engine.abort_request("abort-me")
    assert sorted(o.index for o in outs) == [0, 1, 2] and all(o.finish_reason == "abort" for o in outs)
    assert not engine.has_unfinished_requests() and not engine.has_request("abort-me")
    engine.add_request("abort-early", PROMPTS[4], SamplingParams(n=2, max_tokens=5))  # forks still pending
    assert sorted(o.index for o in engine.abort_request(["abort-early"])) == [0, 1]
    assert not engine.has_unfinished_requests()
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
