"""The engine with everything a GPU run uses, forced on the CPU, token-identical to Hugging Face.

- the Triton attention backend (`attention_backend="triton"`) and Triton transfer kernels run in
  Triton's interpreter (tests/conftest.py set TRITON_INTERPRET=1 before triton was imported);
- on the P/D path, the connector's CUDA data path (`StagedTransfer`: pinned-pool staging, copy
  and save streams, per-layer events) runs with the CPU platform, where copies are memcpys and
  events no-ops.
Monolithic with chunked prefill and prefix-cache hits, and prefill -> file store -> decode.
Lengths sit on block (16) and chunk (64) boundaries; the interpreter is slow, so prompts are short.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.connectors import staging
from pdserve.serving import LLM, SamplingParams
from pdserve.kernels import ops, triton_attention, triton_transfer
from tests.helpers.connector import PREFILL, hf_greedy, prompt
from tests.helpers.kernels import count_calls

MAX_TOKENS = 4
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
OPTIONS = dict(attention_backend="triton", block_size=16, kv_cache_memory="4MiB", max_num_batched_tokens=48)
LENGTHS = (1, 16, 17, 70)


@pytest.fixture()
def triton_kernels(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    calls = count_calls([(triton_transfer, "reshape_and_cache"), (triton_attention, "paged_decode_attention"),
                         (triton_attention, "context_attention"), (triton_transfer, "gather_kv"),
                         (triton_transfer, "scatter_kv")], monkeypatch.setattr)
    with ops.use_backend("triton"):  # the connectors' transfers too
        yield calls


@pytest.mark.slow  # seconds: outside make test-quick
def test_monolithic_triton_matches_hf(tiny_llama: Path, triton_kernels: dict[str, int]) -> None:
    prompts = [prompt(n, seed=7) for n in LENGTHS]
    expected = hf_greedy(tiny_llama, prompts, MAX_TOKENS)
    llm = LLM(str(tiny_llama), **OPTIONS)
    assert llm.engine.model_runner.attn_backend.name == "triton"
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected  # chunked: 48-token budget
    again = llm.generate(prompts[-1:], GREEDY)  # attends over a cached paged prefix
    assert again[0].token_ids == expected[-1] and again[0].num_cached_tokens == 64
    assert all(triton_kernels.get(k, 0) > 0 for k in ("reshape_and_cache", "paged_decode_attention",
                                                      "context_attention"))


@pytest.mark.slow  # seconds: outside make test-quick
def test_prefill_file_store_decode_triton_and_staging_match_hf(tiny_llama: Path, tmp_path: Path,
                                                               triton_kernels: dict[str, int],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(staging, "use_staging", lambda platform: True)  # the CUDA data path, on the CPU
    prompts = [prompt(n, seed=8) for n in (17, 64, 65, 130)]
    expected = hf_greedy(tiny_llama, prompts, MAX_TOKENS)
    kw = dict(OPTIONS, kv_store=f"file://{tmp_path}", chunk_size=64)
    producer = LLM(str(tiny_llama), kv_role="kv_producer", **kw)
    consumer = LLM(str(tiny_llama), kv_role="kv_consumer", **kw)
    transfers = [e.engine.connector.transfer for e in (producer, consumer)]
    assert all(isinstance(t, staging.StagedTransfer) for t in transfers)
    assert [o.token_ids for o in producer.generate(prompts, PREFILL)] == [e[:1] for e in expected]
    before = consumer.engine.get_stats().num_prompt_tokens_computed
    out = consumer.generate(prompts, GREEDY)
    assert [o.token_ids for o in out] == expected
    assert consumer.engine.get_stats().num_prompt_tokens_computed - before == len(prompts)  # KV came from the store
    assert [o.num_cached_tokens for o in out] == [len(p) - 1 for p in prompts]
    for t in transfers:  # every staging buffer went back to the pool, and the pool was reused
        assert t.pool.num_free == t.pool.num_allocations > 0
        assert t.pool.num_acquired > t.pool.num_allocations
    assert triton_kernels["gather_kv"] > 0 and triton_kernels["scatter_kv"] > 0
