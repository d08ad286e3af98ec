"""A stream resumed on another engine from the tokens already sent continues exactly where it stopped.

What the proxy does when a decode node dies mid-stream (engine side): the new engine gets the prompt
plus the output tokens the client has, recomputes them, and sends only what comes after. Greedy and
seeded sampling must equal the uninterrupted run token for token, text and usage included.
"""
from __future__ import annotations

import pytest

from pdserve.engine import SamplingParams
from pdserve.engine.outputs import Resume
from tests.helpers.connector import mono_engine, prompt

pytestmark = pytest.mark.slow

CASES = {
    "greedy": SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=30, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True, logprobs=True),
    "stop": None,  # greedy with a stop string taken from the middle of the greedy output (see below)
}


def run(llm, rid, ids, params, resume=None):
    """Every output of one request, stepping the engine alone."""
    llm.engine.add_request(rid, ids, params, resume=resume)
    outs = []
    while llm.engine.has_unfinished_requests():
        outs.extend(o for o in llm.engine.step() if o.request_id == rid)
    return outs


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("cut", [1, 11])
def test_resumed_stream_equals_the_uninterrupted_one(tiny_llama, case, cut):
    llm = mono_engine(tiny_llama)
    ids = prompt(37, seed=90)
    params = CASES[case]
    if params is None:  # the stop string ends the text near its middle, after the cut: hold-back matters
        text = run(llm, f"probe-{cut}", ids, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))[-1].text
        assert len(text) > 12
        params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, stop=[text[8:10]])
    whole = run(llm, f"whole-{case}-{cut}", ids, params)
    final = whole[-1]
    sent_tokens, sent_text, sent_logprobs = [], "", []
    for out in whole:  # what a client had after `cut` tokens
        if len(sent_tokens) >= cut:
            break
        sent_tokens += out.new_token_ids
        sent_text += out.new_text
        sent_logprobs += out.new_logprobs
    rest = run(llm, f"rest-{case}-{cut}", ids, params, Resume(sent_tokens, len(sent_text)))
    assert sent_tokens + [t for o in rest for t in o.new_token_ids] == final.token_ids
    assert sent_text + "".join(o.new_text for o in rest) == final.text
    assert (rest[-1].finish_reason, rest[-1].token_ids, rest[-1].stop_reason) == \
        (final.finish_reason, final.token_ids, final.stop_reason)
    if params.logprobs:
        got = sent_logprobs + [lp for o in rest for lp in o.new_logprobs]
        assert got == pytest.approx([lp for o in whole for lp in o.new_logprobs], abs=1e-4)


def test_resume_past_max_tokens_is_refused(tiny_llama):
    llm = mono_engine(tiny_llama)
    with pytest.raises(ValueError, match="nothing to resume"):
        llm.engine.add_request("over", prompt(5, seed=91), SamplingParams(max_tokens=3),
                               resume=Resume([5, 6, 7], 0))
