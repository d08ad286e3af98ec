"""Tensor parallelism: TP=2 on two real processes (gloo) against transformers, fp32 greedy.

Each test starts rank 1 as a child process through `LLM(..., tensor_parallel_size=2)`; `parallel_llm`
checks the child is gone after shutdown. Outputs must equal HF's token for token (the tiny models'
greedy choices are far apart, so all-reduce rounding never flips one: no divergence is tolerated here).
"""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from pdserve.common.cpu_budget import read_budget
from pdserve.engine.builtin_model import make_model
from pdserve.engine.parallel.launcher import RankFailure
from pdserve.serving import LLM, SamplingParams
from tests.helpers.parallel import GREEDY, child_pids, generate, parallel_llm, wait_gone
from tests.helpers.oracles import hf_greedy
from tests.helpers.prompts import random_prompt
from tests.helpers.timing import HANG_S

# The collective (and join) deadline of the tests that kill a rank: far beyond HANG_S, so that a death
# noticed only when a deadline passes fails them however slow the machine.
COLLECTIVE_S = 4 * HANG_S
LENGTHS = [1, 17, 100, 257]
PROMPTS = [random_prompt(n, seed=n) for n in LENGTHS]
# the same prompts again (prefix-cache hits) and a new suffix on a shared prefix
WAVE2 = PROMPTS + [PROMPTS[-1][:200] + random_prompt(9, 3)]


@pytest.fixture(scope="module")
def llama_refs(tiny_llama):
    return hf_greedy(tiny_llama, WAVE2)


@pytest.mark.slow  # seconds: outside make test-quick
def test_tp2_matches_hf_with_chunked_prefill_and_prefix_hits(tiny_llama, llama_refs):
    with parallel_llm(tiny_llama, tp=2, max_num_batched_tokens=64) as llm:
        assert generate(llm, PROMPTS) == llama_refs[:len(PROMPTS)]
        before = llm.engine.get_stats().prefix_cache_hits
        outs = llm.generate(WAVE2, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == llama_refs
        assert llm.engine.get_stats().prefix_cache_hits - before == sum(o.num_cached_tokens for o in outs) > 0
        # n=2 forks copy the partial prompt block (a COPY command to rank 1): both greedy choices equal HF's
        forked = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=12, temperature=0.0, n=2))[0]
        assert [c.token_ids for c in forked.outputs] == [llama_refs[1]] * 2


@pytest.mark.slow  # seconds: outside make test-quick
def test_tp2_replicates_kv_heads_when_tp_exceeds_them(tmp_path, caplog):
    path = make_model(tmp_path / "kv1", preset="tiny", arch="llama", num_kv_heads=1)
    caplog.set_level("INFO", logger="pdserve")
    with parallel_llm(path, tp=2) as llm:
        assert generate(llm, PROMPTS) == hf_greedy(path, PROMPTS)
    text = caplog.text
    assert "rank 0 (pp 0, tp 0): layers [0, 4), q heads [0, 2), kv heads [0, 1)," in text
    assert "rank 1 (pp 0, tp 1): layers [0, 4), q heads [2, 4), kv heads [0, 1) (replica)" in text


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral", "gemma3"])
@pytest.mark.slow  # seconds: outside make test-quick
def test_tp2_every_model_family_matches_hf(tmp_path, arch):
    path = make_model(tmp_path / arch, preset="tiny", arch=arch)
    with parallel_llm(path, tp=2) as llm:
        assert generate(llm, PROMPTS[:3]) == hf_greedy(path, PROMPTS[:3])


@pytest.mark.slow  # seconds: outside make test-quick
def test_tp1_engine_after_tp2_in_the_same_process(tiny_llama, llama_refs):
    """The TP group belongs to its engine: a later TP=1 engine never all-reduces against the TP=2 one's peer,
    whether that engine is still alive or already shut down. While the TP=2 engine runs, its ranks share the
    CPUs (torch threads: an equal share each); the process gets its threads back when it stops."""
    threads = torch.get_num_threads()
    with parallel_llm(tiny_llama, tp=2) as tp2:
        assert torch.get_num_threads() == max(1, read_budget().cpus // 2)  # the CPUs it may use, not the host's
        assert generate(tp2, PROMPTS[:2]) == llama_refs[:2]
        single = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="16MiB")
        assert generate(single, PROMPTS[:2]) == llama_refs[:2]
        assert generate(tp2, PROMPTS[2:3]) == llama_refs[2:3]
    assert torch.get_num_threads() == threads
    assert generate(single, PROMPTS[2:3]) == llama_refs[2:3]
    assert generate(LLM(str(tiny_llama), dtype="float32", kv_cache_memory="16MiB"), PROMPTS[:1]) == llama_refs[:1]


@pytest.mark.slow  # seconds: outside make test-quick
def test_prompt_logprobs_under_tp2_equal_one_process(tiny_llama):
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1, logprobs=1)
    single = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="16MiB").generate(PROMPTS[1:3], params)
    with parallel_llm(tiny_llama, tp=2) as llm:
        split = llm.generate(PROMPTS[1:3], params)
    for a, b in zip(single, split):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert pa.keys() == pb.keys()
            assert all(abs(pa[k].logprob - pb[k].logprob) < 1e-4 for k in pa)


@pytest.mark.parametrize("options, message", [
    (dict(tensor_parallel_size=3), "must divide the model's 4 attention heads"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be an integer >= 1"),
    (dict(pipeline_parallel_size=5), "pipeline_parallel_size=5 exceeds the model's 4 layers"),
    (dict(tensor_parallel_size=2, kv_store="lm://127.0.0.1:1", kv_role="kv_producer"), "LMCache connector serves one"),
])
@pytest.mark.slow  # seconds: outside make test-quick
def test_bad_layouts_are_clear_errors_and_start_no_process(tiny_llama, options, message):
    before = child_pids()
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_llama), dtype="float32", **options)
    assert child_pids() == before


@pytest.mark.slow  # seconds: outside make test-quick
def test_a_killed_rank_fails_the_engine_before_the_collective_timeout(tiny_llama):
    before = child_pids()
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="16MiB", tensor_parallel_size=2,
              distributed_timeout_s=COLLECTIVE_S)
    (rank1,) = child_pids() - before
    assert generate(llm, PROMPTS[:1]) == generate(llm, PROMPTS[:1])
    os.kill(rank1, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1"):
        generate(llm, PROMPTS[:2])
    seconds = time.monotonic() - start
    assert seconds < HANG_S, f"{seconds:.0f} s: the rank's death was found by the collective timeout, not at once"
    llm.engine.shutdown()
    assert not wait_gone({rank1})



def test_a_rank_killed_during_start_up_fails_it_clearly(tiny_llama):
    """Rank 1 is killed as soon as it exists: start-up fails naming it, well before the collective timeout,
    and no process is left."""
    before = child_pids()
    killed: list[int] = []

    def kill_new_rank() -> None:
        deadline = time.monotonic() + HANG_S
        while not killed and time.monotonic() < deadline:
            for pid in child_pids() - before:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            time.sleep(0.01)

    killer = threading.Thread(target=kill_new_rank)
    killer.start()
    start = time.monotonic()
    try:
        with pytest.raises(RankFailure, match="rank 1"):  # (the join's own deadline names no rank)
            LLM(str(tiny_llama), dtype="float32", kv_cache_memory="16MiB", tensor_parallel_size=2,
                distributed_timeout_s=COLLECTIVE_S)
    finally:
        killer.join()
    seconds = time.monotonic() - start
    assert seconds < HANG_S, f"{seconds:.0f} s: the rank's death was found by the join deadline, not at once"
    assert killed and not wait_gone(set(killed))
    assert child_pids() == before
