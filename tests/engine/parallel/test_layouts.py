"""Tensor and pipeline parallelism together: TP=2 x PP=2 and TP=4, four real rank processes (gloo),
against transformers' greedy output token for token in fp32; and PP=2 on the real SmolLM2.

The tiny model here has 8 q heads and 4 KV heads, so every split is a real one (at TP=4 each rank owns one KV
head, no replica). Four ranks share this machine's cores: prompts are short, outputs 8 tokens, and one engine
per layout runs every case (a batched wave with a chunked prefill, then prefix-cache hits and a new suffix).
As in tests/engine/parallel/test_tp.py, no divergence is tolerated: the tiny models' greedy choices are far apart.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.engine.builtin_model import make_model
from pdserve.engine.tokenizer import load_tokenizer
from pdserve.serving import LLM, SamplingParams
from tests.helpers.parallel import generate, parallel_llm
from tests.helpers.real_model import CONVERSATIONS, chat_ids, near_ties
from tests.helpers.oracles import hf_greedy
from tests.helpers.prompts import random_prompt

pytestmark = pytest.mark.timeout(300)
MAX_TOKENS = 8
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
PROMPTS = [random_prompt(n, seed=n) for n in (1, 17, 40)]  # 40 > max_num_batched_tokens: a chunked prefill
WAVE2 = PROMPTS + [PROMPTS[-1][:32] + random_prompt(5, 3)]  # the same prompts again, and a shared prefix
# The ranks' join and every collective: four ranks each importing torch and loading their shard took up to 26 s
# on a busy 2-core machine (past parallel_helpers' 20 s), SmolLM2's two about 15 s. A generous deadline, since
# it only bounds a hang: a rank that dies is found at once (rank 0 polls them).
START_TIMEOUT_S = 120
LAYOUTS = {  # (tp, pp) -> the start-up line of the last rank: its layers and heads, as the split should give
    (2, 2): "rank 3 (pp 1, tp 1): layers [2, 4), q heads [4, 8), kv heads [2, 4)",
    (4, 1): "rank 3 (pp 0, tp 3): layers [0, 4), q heads [6, 8), kv heads [3, 4), embedding and LM head",
}


@pytest.fixture(scope="module")
def heads8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with 8 q heads and 4 KV heads of 16 dims (hidden size 128 as the preset's)."""
    return make_model(tmp_path_factory.mktemp("heads8"), preset="tiny", arch="llama", num_attention_heads=8,
                      num_key_value_heads=4, head_dim=16)


@pytest.fixture(scope="module")
def refs(heads8: Path) -> list[list[int]]:
    return hf_greedy(heads8, WAVE2, max_tokens=MAX_TOKENS)


class _Lines(logging.Handler):
    """The messages pdserve logs while it is attached (the engines' start-up lines)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module", params=list(LAYOUTS), ids=lambda layout: f"tp{layout[0]}xpp{layout[1]}")
def four_ranks(request: pytest.FixtureRequest, heads8: Path) -> Iterator[tuple[LLM, tuple[int, int], str]]:
    """One engine per layout for every test of it, with the lines it logged while starting."""
    tp, pp = request.param
    logger, lines = logging.getLogger("pdserve"), _Lines()
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(lines)
    with contextlib.ExitStack() as stack:
        try:
            llm = stack.enter_context(parallel_llm(heads8, tp=tp, pp=pp, max_num_batched_tokens=32,
                                                   distributed_timeout_s=START_TIMEOUT_S))
        finally:
            logger.removeHandler(lines)
            logger.setLevel(level)
        yield llm, (tp, pp), "\n".join(lines.messages)


@pytest.mark.slow
def test_four_ranks_split_layers_and_heads_as_the_layout_says(four_ranks) -> None:
    """The last rank holds the layers and heads the split gives it: the comparison with HF below runs on a
    real four-way split, not on a layout that fell back to fewer ranks or replicated heads."""
    _, (tp, pp), started = four_ranks
    assert f"tensor_parallel_size {tp} x pipeline_parallel_size {pp} = 4 ranks over 4 layers, 8 q heads, " \
           "4 kv heads" in started
    assert LAYOUTS[(tp, pp)] in started
    assert "(replica)" not in started


@pytest.mark.slow
def test_four_ranks_match_hf_with_chunked_prefill_and_prefix_hits(four_ranks, refs: list[list[int]]) -> None:
    llm, _, _ = four_ranks
    assert generate(llm, PROMPTS, PARAMS) == refs[:len(PROMPTS)]
    outs = llm.generate(WAVE2, PARAMS)
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert sum(o.num_cached_tokens for o in outs) > 0  # the second wave did read the prefix cache


@pytest.mark.slow
def test_pp2_on_smollm2_equals_hf_greedy(smollm2: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The real model split in two stages of 15 layers: real chat prompts, greedy, fp32, HF's tokens."""
    tokenizer = load_tokenizer(smollm2)
    prompts = [chat_ids(tokenizer, c) for c in CONVERSATIONS[:3]]
    caplog.set_level("INFO", logger="pdserve")
    with parallel_llm(smollm2, pp=2, kv_cache_memory="64MiB", max_num_batched_tokens=48,
                      distributed_timeout_s=START_TIMEOUT_S) as llm:
        outputs = generate(llm, prompts, PARAMS)
    assert "rank 1 (pp 1, tp 0): layers [15, 30)" in caplog.text
    assert all(len(out) == MAX_TOKENS for out in outputs)
    assert near_ties(smollm2, prompts, outputs) == []  # every token HF's greedy choice, none even a near tie
