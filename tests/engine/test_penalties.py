"""Penalties, logit_bias, min_tokens and min_p: the batched versions against straightforward loops."""
from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine.logits_processors import process_logits
from pdserve.engine.penalties import apply_penalties
from pdserve.engine.request import Request
from pdserve.engine.sampler import Sampler
from pdserve.engine.sampling_params import BOUNDS, SamplingParams, SamplingParamsError
from tests.helpers.oracles import reference_penalties

VOCAB = 50


def request(rid: str, prompt: list[int], output: list[int], **params) -> Request:
    r = Request(rid, prompt, SamplingParams(**params), eos_token_id=1)
    for t in output:
        r.append_output_token(t)
    return r


def random_case(rng: random.Random) -> tuple[list[int], list[int], float, float, float]:
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 30))]
    output = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 30))]
    return prompt, output, rng.uniform(-2, 2), rng.uniform(-2, 2), rng.choice([1.0, rng.uniform(0.5, 2.0)])


def test_batched_penalties_match_the_reference():
    rng = random.Random(0)
    logits = torch.randn(16, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    cases = [random_case(rng) for _ in range(16)]
    got = apply_penalties(logits, *(list(col) for col in zip(*cases)))
    for row, (prompt, output, pres, freq, rep) in enumerate(cases):
        torch.testing.assert_close(got[row], reference_penalties(logits[row], prompt, output, pres, freq, rep))


def test_process_logits_applies_only_to_rows_that_ask_and_leaves_the_input_alone():
    rng = random.Random(1)
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1))
    raw = logits.clone()
    prompt, output, pres, freq, rep = random_case(rng)
    bias = {3: 5.0, 7: -100.0, 11: 0.5}
    reqs = [request("plain", prompt, output),
            request("pen", prompt, output, presence_penalty=pres, frequency_penalty=freq, repetition_penalty=rep),
            request("bias", prompt, output, logit_bias=bias),
            request("min", prompt, output[:2], min_tokens=5, max_tokens=9, stop_token_ids=[4, 9])]
    out = process_logits(logits, reqs)
    assert torch.equal(logits, raw) and out is not logits
    torch.testing.assert_close(out[0], raw[0])
    torch.testing.assert_close(out[1], reference_penalties(raw[1], prompt, output, pres, freq, rep))
    expected = raw[2].clone()
    for t, b in bias.items():
        expected[t] += b
    torch.testing.assert_close(out[2], expected)
    banned = {1, 4, 9}  # EOS and the stop_token_ids, while fewer than min_tokens were generated
    assert all(out[3, t] == float("-inf") for t in banned)
    assert torch.equal(out[3, [t for t in range(VOCAB) if t not in banned]],
                       raw[3, [t for t in range(VOCAB) if t not in banned]])
    assert process_logits(logits, [reqs[0]]) is logits  # nothing asked: no copy


def test_min_tokens_lifts_after_enough_tokens_and_respects_ignore_eos():
    logits = torch.zeros(2, VOCAB)
    done = request("done", [5], [6] * 5, min_tokens=5, max_tokens=9)
    no_eos_ban = request("ig", [5], [], min_tokens=5, max_tokens=9, ignore_eos=True)
    out = process_logits(logits, [done, no_eos_ban])
    assert torch.equal(out, logits)  # min_tokens reached; ignore_eos without stop ids bans nothing


def test_greedy_sampling_follows_processed_logits_but_reports_raw_logprobs():
    logits = torch.zeros(1, VOCAB)
    logits[0, 2] = 3.0
    tokens, logprobs = Sampler()(logits, [request("b", [5], [], temperature=0.0, logit_bias={7: 10.0}, logprobs=True)])
    assert tokens == [7]
    assert logprobs[0] == pytest.approx(torch.log_softmax(logits[0], -1)[7].item())
    tokens, _ = Sampler()(logits, [request("r", [2], [], temperature=0.0, repetition_penalty=2.0,
                                           logit_bias={5: 1.6})])
    assert tokens == [5]  # 3.0 / 2 = 1.5 < 1.6


def test_min_p_keeps_only_tokens_near_the_top():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    sampler = Sampler(seed=0)
    reqs = [request(str(i), [0], [], min_p=0.4) for i in range(400)]
    tokens, _ = sampler(logits.expand(400, -1).clone(), reqs)
    assert set(tokens) == {0, 1}  # 0.15 < 0.4 * 0.5


@pytest.mark.parametrize("bad", [{"x": 1.0}, {-1: 1.0}, {3: 101.0}, {3: float("nan")}, {True: 1.0}])
def test_bad_logit_bias_is_refused(bad):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bad)


@pytest.mark.parametrize("field,value", [("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0),
                                         ("min_tokens", 20), ("n", 0), ("min_p", 1.5), ("prompt_logprobs", 21)])
def test_out_of_range_params_name_themselves(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(max_tokens=16, **{field: value})


@pytest.mark.parametrize("field,ok,bad", [
    ("temperature", [0, 0.7, 2.0], [-0.1, 2.01, 100.0]),  # vLLM >= 0.24 caps at 2, as OpenAI (was 100 here)
    ("repetition_penalty", [0.01, 1.0, 2.0, 3.5, 100.0], [0.0, -1.0, float("inf")]),  # any finite > 0
    ("top_p", [0.01, 1.0], [0.0, 1.01]), ("top_k", [-1, 0, 50], [-2]), ("min_p", [0.0, 1.0], [1.5, -0.1]),
    ("presence_penalty", [-2.0, 2.0], [2.5]), ("n", [1, 128], [0, 129]),
])
def test_bounds_are_vllms_and_errors_carry_the_field(field, ok, bad):
    for value in ok:
        SamplingParams(**{field: value})
    for value in bad:
        with pytest.raises(SamplingParamsError) as e:
            SamplingParams(**{field: value})
        assert e.value.param == field and str(e.value).startswith(f"{field} must be "), e.value
        if value != float("inf"):
            assert str(e.value) == f"{field} must be {BOUNDS[field]}, got {value}"


def test_cross_field_rules_name_their_field():
    for kwargs, param in [({"max_tokens": 4, "min_tokens": 5}, "min_tokens"), ({"logprob_token_ids": [3]},
                          "logprob_token_ids"), ({"n": 3, "seed": 2**63 - 2}, "seed"), ({"logprobs": 21}, "logprobs"),
                          ({"n": 2, "use_beam_search": True, "stop": ["x"]}, "stop")]:
        with pytest.raises(SamplingParamsError) as e:
            SamplingParams(**kwargs)
        assert e.value.param == param, e.value
    with pytest.raises(SamplingParamsError, match="allowed_token_ids token id 9 is outside the vocabulary") as e:
        SamplingParams(allowed_token_ids=[3, 9]).check_token_ids(8)
    assert e.value.param == "allowed_token_ids"


def test_number_fields_become_floats():
    params = SamplingParams(temperature=1, top_p=1, repetition_penalty=2)
    assert all(type(v) is float for v in (params.temperature, params.top_p, params.repetition_penalty))


def test_logit_bias_keys_may_be_json_strings():
    assert SamplingParams(logit_bias={"12": -5}).logit_bias == {12: -5.0}
