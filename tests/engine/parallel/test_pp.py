"""Pipeline parallelism: PP=2 on two real processes (gloo) against transformers, fp32 greedy.

Rank 0 embeds and runs the first layers, sends (hidden, residual) to rank 1, which runs the rest and the
final norm and sends the sampled rows' hidden states back: the LM head and sampling stay on rank 0.
"""
from __future__ import annotations

import pytest

from pdserve.engine.builtin_model import make_model
from pdserve.engine.parallel.layout import pp_layer_ranges
from pdserve.serving import SamplingParams
from tests.helpers.parallel import GREEDY, generate, parallel_llm
from tests.helpers.oracles import hf_greedy
from tests.helpers.prompts import random_prompt

LENGTHS = [1, 17, 100, 257]
PROMPTS = [random_prompt(n, seed=n) for n in LENGTHS]
WAVE2 = PROMPTS + [PROMPTS[-1][:200] + random_prompt(9, 3)]


def test_layer_split_gives_the_remainder_to_the_stages_before_the_last():
    assert pp_layer_ranges(4, 2) == [(0, 2), (2, 4)]
    assert pp_layer_ranges(3, 2) == [(0, 2), (2, 3)]
    assert pp_layer_ranges(7, 3) == [(0, 2), (2, 5), (5, 7)]
    assert pp_layer_ranges(30, 4) == [(0, 7), (7, 15), (15, 23), (23, 30)]


@pytest.mark.slow  # seconds: outside make test-quick
def test_pp2_matches_hf_with_chunked_prefill_and_prefix_hits(tiny_llama, caplog):
    refs = hf_greedy(tiny_llama, WAVE2)
    caplog.set_level("INFO", logger="pdserve")
    with parallel_llm(tiny_llama, pp=2, max_num_batched_tokens=64) as llm:
        assert generate(llm, PROMPTS) == refs[:len(PROMPTS)]
        outs = llm.generate(WAVE2, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == refs
        assert sum(o.num_cached_tokens for o in outs) > 0
        forked = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=12, temperature=0.0, n=2))[0]
        assert [c.token_ids for c in forked.outputs] == [refs[1]] * 2
    assert "rank 0 (pp 0, tp 0): layers [0, 2), q heads [0, 4), kv heads [0, 2), embedding and LM head" in caplog.text
    assert "rank 1 (pp 1, tp 0): layers [2, 4), q heads [0, 4), kv heads [0, 2), final norm" in caplog.text


@pytest.mark.slow  # seconds: outside make test-quick
def test_pp2_uneven_layer_count_matches_hf(tmp_path, caplog):
    path = make_model(tmp_path / "l3", preset="tiny", arch="llama", num_hidden_layers=3)
    caplog.set_level("INFO", logger="pdserve")
    with parallel_llm(path, pp=2) as llm:
        assert generate(llm, PROMPTS) == hf_greedy(path, PROMPTS)
    assert "rank 1 (pp 1, tp 0): layers [2, 3)" in caplog.text
    # each rank sizes its cache for its own layers (2 and 1): rank 1 could hold more, the minimum is taken
    assert "rank 0: KV cache: 16777216 bytes budget // (2 layers x 8192 bytes/block/layer) = 1024 blocks" in caplog.text
    assert "KV cache: 1024 blocks on every rank (the minimum over 2 ranks; this rank's own: 1024)" in caplog.text


@pytest.mark.parametrize("arch", ["gemma3", "qwen2"])
@pytest.mark.slow  # seconds: outside make test-quick
def test_pp2_other_families_match_hf(tmp_path, arch):
    """Gemma 3 hands one stream between stages (no separate residual); Qwen2 ties its embeddings."""
    path = make_model(tmp_path / arch, preset="tiny", arch=arch)
    with parallel_llm(path, pp=2) as llm:
        assert generate(llm, PROMPTS[:3]) == hf_greedy(path, PROMPTS[:3])


@pytest.mark.slow  # seconds: outside make test-quick
def test_pp2_prompt_logprobs_come_back_to_rank0(tiny_llama):
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1)
    with parallel_llm(tiny_llama) as single:
        want = single.generate(PROMPTS[2:3], params)[0]
    with parallel_llm(tiny_llama, pp=2) as llm:
        got = llm.generate(PROMPTS[2:3], params)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    for a, b in zip(want.prompt_logprobs[1:], got.prompt_logprobs[1:]):
        assert a.keys() == b.keys() and all(abs(a[k].logprob - b[k].logprob) < 1e-4 for k in a)
