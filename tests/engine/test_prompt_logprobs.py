"""prompt_logprobs against Hugging Face's forward pass, whatever the prefix cache holds or the chunking is."""
from __future__ import annotations

import pytest
import torch

from pdserve.serving import LLM, SamplingParams
from tests.helpers.prompts import random_prompt

PROMPT = random_prompt(40, seed=7)
K = 3


@pytest.fixture(scope="module")
def hf_logprobs(tiny_llama) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([PROMPT])).logits[0].float(), dim=-1)


def check(prompt_logprobs, hf: torch.Tensor) -> None:
    assert len(prompt_logprobs) == len(PROMPT) and prompt_logprobs[0] is None
    for j in range(1, len(PROMPT)):
        entry, row = prompt_logprobs[j], hf[j - 1]
        token = PROMPT[j]
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top = row.topk(K).indices.tolist()
        assert set(entry) == set(top) | {token}
        assert [entry[t].rank for t in top] == [1, 2, 3]
        assert entry[token].decoded_token is not None


def test_prompt_logprobs_match_hf_and_ignore_the_prefix_cache(tiny_llama, hf_logprobs):
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="16MiB")
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=K)
    for _ in range(2):  # the second time every full block is in the prefix cache: still computed
        before = llm.engine.get_stats().num_prompt_tokens_computed
        out = llm.generate([PROMPT], params)[0]
        assert llm.engine.get_stats().num_prompt_tokens_computed - before == len(PROMPT)
        check(out.prompt_logprobs, hf_logprobs)
    plain = llm.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0.0))[0]
    assert plain.prompt_logprobs is None and plain.num_cached_tokens == 32 and plain.token_ids == out.token_ids


def test_prompt_logprobs_with_chunked_prefill_and_n(tiny_llama, hf_logprobs):
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=12)
    result, = llm.generate([PROMPT], SamplingParams(n=2, max_tokens=2, temperature=1.0, seed=1, prompt_logprobs=K))
    assert [o.index for o in result.outputs] == [0, 1]  # the prompt's logprobs once, beside its n choices
    check(result.prompt_logprobs, hf_logprobs)
    zero = llm.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=0))[0].prompt_logprobs
    assert all(list(e) == [t] for e, t in zip(zero[1:], PROMPT[1:]))  # only the prompt token itself
