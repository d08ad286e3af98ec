"""Sampler: exact greedy, temperature/top-k/top-p distributions, batch-independent seeds, logprobs."""
from __future__ import annotations

import torch

from pdserve.engine.request import Request
from pdserve.engine.sampler import Sampler
from pdserve.engine.sampling_params import SamplingParams


def req(rid: str = "r", n_tokens: int = 3, **params) -> Request:
    return Request(rid, list(range(3, 3 + n_tokens)), SamplingParams(**params))


def frequencies(logits: torch.Tensor, draws: int, **params) -> torch.Tensor:
    sampler = Sampler(seed=0)
    tokens, _ = sampler(logits.expand(draws, -1).clone(), [req(str(i), **params) for i in range(draws)])
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[-1]).float() / draws


def test_greedy_is_exact_argmax_and_logprob_uses_raw_logits():
    logits = torch.randn(5, 384, generator=torch.Generator().manual_seed(0))
    tokens, logprobs = Sampler()(logits, [req(temperature=0.0, logprobs=True)] * 5)
    assert tokens == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1).max(-1).values
    torch.testing.assert_close(torch.tensor(logprobs), expected)
    # Logprobs are computed (and transferred) only for the requests that asked.
    mixed = [req(temperature=0.0), req(temperature=0.0, logprobs=True)] + [req(temperature=0.0)] * 3
    tokens, logprobs = Sampler()(logits, mixed)
    assert tokens == logits.argmax(-1).tolist()
    assert logprobs[0] is None and logprobs[2:] == [None] * 3 and abs(logprobs[1] - float(expected[1])) < 1e-6
    assert Sampler()(logits, [req(temperature=0.0)] * 5)[1] == [None] * 5


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(4, 384, generator=torch.Generator().manual_seed(1))
    greedy = logits.argmax(-1).tolist()
    assert Sampler()(logits, [req(temperature=1.5, top_k=1)] * 4)[0] == greedy
    assert Sampler()(logits, [req(temperature=1.5, top_p=1e-6)] * 4)[0] == greedy


def test_distributions_follow_temperature_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.4, 0.35, 0.25]]))
    freq = frequencies(logits, 4000, temperature=1.0)
    torch.testing.assert_close(freq, torch.tensor([0.4, 0.35, 0.25]), atol=0.03, rtol=0)
    hot = frequencies(logits, 4000, temperature=2.0)
    torch.testing.assert_close(hot, torch.softmax(logits[0] / 2.0, -1), atol=0.03, rtol=0)
    top_k = frequencies(logits, 2000, temperature=1.0, top_k=2)
    assert top_k[2] == 0 and abs(top_k[0] - 0.4 / 0.75) < 0.04
    top_p = frequencies(logits, 2000, temperature=1.0, top_p=0.5)  # 0.4 < 0.5, so the second token stays
    assert top_p[2] == 0 and top_p[1] > 0.3


def test_seeded_token_depends_on_seed_and_position_not_batch():
    logits = torch.zeros(1, 384)  # uniform: the draw is all noise
    alone = Sampler(seed=1)(logits, [req(seed=42, n_tokens=10)])[0]
    others = [req(str(i), n_tokens=10) for i in range(3)]
    batched = Sampler(seed=2)(logits.expand(4, -1).clone(), others[:2] + [req(seed=42, n_tokens=10)] + others[2:])[0]
    assert batched[2] == alone[0]
    # Beside requests with top-k / top-p (which sort the vocabulary; plain rows do not) it is the same too.
    ranked = [req("k", n_tokens=10, top_k=5), req("p", n_tokens=10, top_p=0.5)]
    mixed = Sampler(seed=3)(logits.expand(3, -1).clone(), ranked[:1] + [req(seed=42, n_tokens=10)] + ranked[1:])[0]
    assert mixed[1] == alone[0]
    top_k_alone = Sampler(seed=4)(logits, [req(seed=7, n_tokens=10, top_k=5)])[0]
    top_k_mixed = Sampler(seed=5)(logits.expand(2, -1).clone(), [req(n_tokens=10), req(seed=7, n_tokens=10, top_k=5)])[0]
    assert top_k_mixed[1] == top_k_alone[0]
    firsts = {Sampler()(logits, [req(seed=s, n_tokens=10)])[0][0] for s in range(20)}
    positions = {Sampler()(logits, [req(seed=42, n_tokens=n)])[0][0] for n in range(10, 30)}
    assert len(firsts) > 10 and len(positions) > 10


def test_top_logprobs_only_for_requests_that_ask_and_match_log_softmax():
    logits = torch.randn(3, 384, generator=torch.Generator().manual_seed(4))
    tops = Sampler.top_logprobs(logits, [req(top_logprobs=5), req(), req(top_logprobs=2)])
    assert set(tops) == {0, 2} and [len(tops[0]), len(tops[2])] == [5, 2]
    for row, top in tops.items():
        values, ids = torch.log_softmax(logits[row], -1).topk(len(top))
        assert [t for t, _ in top] == ids.tolist()
        torch.testing.assert_close(torch.tensor([lp for _, lp in top]), values)
    assert Sampler.top_logprobs(logits, [req(logprobs=True)] * 3) == {}


def test_top_logprobs_validated_and_imply_logprobs():
    assert SamplingParams(top_logprobs=3).logprobs and not SamplingParams().logprobs
    for bad in (-1, 21, True, 2.0):
        try:
            SamplingParams(top_logprobs=bad)
        except ValueError as e:
            assert "top_logprobs" in str(e)
        else:
            raise AssertionError(f"top_logprobs={bad!r} accepted")
