"""A request that arrives with its first output token (sampled by a P/D prefill node, engine/outputs.FirstToken):
the engine sends that token at once as its own first output and continues exactly as if it had sampled it."""
from __future__ import annotations

import pytest

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import FirstToken, StepOutput
from pdserve.engine.sampling_params import SamplingParams

PROMPT = list(range(5, 45))  # 40 tokens: two full blocks and a partial one


@pytest.fixture(scope="module")
def engine(tiny_llama) -> LLMEngine:
    return LLMEngine.from_kwargs(str(tiny_llama), dtype="float32", kv_cache_memory="32MiB")


def _run(engine: LLMEngine, rid: str, params: SamplingParams, first: FirstToken | None = None,
         prompt: list[int] = PROMPT) -> list[list[StepOutput]]:
    """The outputs of each step until the request ends."""
    engine.add_request(rid, prompt, params, first_token=first)
    steps = []
    while engine.has_unfinished_requests():
        steps.append(engine.step())
    return steps


def _tokens(steps: list[list[StepOutput]]) -> list[int]:
    return [t for outs in steps for o in outs for t in o.new_token_ids]


def test_continuing_from_the_first_token_equals_sampling_it(engine):
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=True, top_logprobs=3, ignore_eos=True)
    mono = [o for outs in _run(engine, "mono", params) for o in outs]
    first = FirstToken(mono[0].new_token_ids[0], mono[0].new_logprobs[0], mono[0].new_top_logprobs[0])
    given = [o for outs in _run(engine, "given", params, first) for o in outs]
    for field in ("new_token_ids", "new_logprobs", "new_top_logprobs", "new_text"):
        assert [x for o in given for x in getattr(o, field)] == [x for o in mono for x in getattr(o, field)], field
    assert given[-1].token_ids == mono[-1].token_ids and given[-1].finish_reason == "length"


def test_the_first_token_goes_out_before_any_computation(tiny_llama):
    engine = LLMEngine.from_kwargs(str(tiny_llama), dtype="float32", kv_cache_memory="32MiB")
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    steps = _run(engine, "r", params, FirstToken(7))
    assert [o.new_token_ids for o in steps[0]] == [[7]]  # before the prompt was computed
    # Without a store to load from, the prompt is computed up to its end in one step and the given token's row
    # in the next, as a decode row (the way monolithic serving computes them): no token comes from the first.
    assert engine.get_stats().num_prompt_tokens_computed == len(PROMPT)
    assert _tokens(steps)[:1] == [7] and len(_tokens(steps)) == 4
    # step 1: the given token's output while the prompt is computed (nothing sampled); then one row per token
    assert [len(o.new_token_ids) for outs in steps for o in outs] == [1, 1, 1, 1] and len(steps) == 4


@pytest.mark.parametrize("params,reason", [
    (SamplingParams(max_tokens=1, temperature=0), "length"),
    (SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[9]), "stop"),
])
def test_a_first_token_that_ends_the_request_needs_no_computation(tiny_llama, params, reason):
    engine = LLMEngine.from_kwargs(str(tiny_llama), dtype="float32", kv_cache_memory="32MiB")
    steps = _run(engine, "r", params, FirstToken(9))
    out = steps[-1][-1]
    assert out.finished and out.finish_reason == reason and out.token_ids == [9]
    assert engine.get_stats().num_prompt_tokens_computed == 0 and len(steps) == 1


def test_a_stop_string_in_the_first_token_ends_it(engine):
    text = engine.tokenizer.decode([40])
    steps = _run(engine, "stop-str", SamplingParams(max_tokens=8, temperature=0, stop=[text]), FirstToken(40))
    out = steps[-1][-1]
    assert out.finished and out.finish_reason == "stop" and out.stop_reason == text and out.text == ""


@pytest.mark.parametrize("params,first,message", [
    (SamplingParams(n=2, max_tokens=4), FirstToken(3), "n = 1"),
    (SamplingParams(max_tokens=4, prompt_logprobs=1), FirstToken(3), "prompt_logprobs"),
    (SamplingParams(max_tokens=4), FirstToken(10 ** 6), "first token id"),
])
def test_a_first_token_that_cannot_apply_is_refused(engine, params, first, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", PROMPT, params, first_token=first)
    assert not engine.has_request("bad")
