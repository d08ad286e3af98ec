"""Producer -> LMCache (a real `lmcache_server` process) -> consumer, with our CPU copy object."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pdserve.connectors.lmcache_connector import chunk_hash
from pdserve.deploy.processes import free_port, require_port
from pdserve.serving import LLM
from tests.helpers.connector import (GREEDY, LENGTHS, LOOKUP_RE, PARTIAL_CASES, capture, check_full_handoff,
                                     check_partial_load, check_salts_never_share, engine_pair, hf_greedy, lines, mono_engine, prompt,
                                     prompt_tokens_computed, token_ids)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def lm_url():
    port = free_port()
    server = subprocess.Popen([str(Path(sys.executable).with_name("lmcache_server")), "127.0.0.1", str(port), "cpu"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        require_port(port, 60)
        yield f"lm://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=10)


@pytest.fixture(scope="module")
def lm_pair(tiny_llama, lm_url):
    producer, consumer = engine_pair(tiny_llama, lm_url)
    yield producer, consumer
    producer.engine.shutdown()
    consumer.engine.shutdown()


@pytest.fixture(scope="module")
def mono(tiny_llama) -> LLM:
    return mono_engine(tiny_llama)


def test_lmcache_handoff_is_exact_and_computes_one_prompt_token(tiny_llama, lm_pair, mono, caplog):
    prompts = [prompt(n, seed=1) for n in LENGTHS]  # the store tests' prompts: one HF run
    expected = hf_greedy(tiny_llama, prompts)
    assert token_ids(mono.generate(prompts, GREEDY)) == expected
    check_full_handoff(*lm_pair, prompts, expected, caplog)


@pytest.mark.parametrize("case,want", PARTIAL_CASES[:1] + PARTIAL_CASES[-1:])
def test_lmcache_local_prefix_loads_only_the_rest(lm_pair, mono, case, want, caplog):
    check_partial_load(*lm_pair, mono, case, want, caplog, seed=60 + sum(case))


def test_lmcache_keys_do_not_depend_on_the_interpreter(lm_pair):
    """Chunk keys are our blake2b chain, not Python's hash()."""
    _, consumer = lm_pair
    tokens = prompt(300, seed=3)
    keys = [key.chunk_hash for _, _, key in consumer.engine.connector.engine.token_database.process_tokens(tokens)]
    first = int.from_bytes(chunk_hash((0, tuple(tokens[:256]), ()))[:8], "big")
    second = int.from_bytes(chunk_hash((first, tuple(tokens[256:]), ()))[:8], "big")
    assert keys == [first, second]


def test_lmcache_hit_across_processes_with_other_hash_seeds(tiny_llama, lm_url, mono, tmp_path, caplog):
    """A producer process with PYTHONHASHSEED=1 stores; this process (another seed) loads via a YAML config."""
    full = prompt(600, seed=4)
    script = textwrap.dedent(f"""
        from pdserve.serving import LLM, SamplingParams
        llm = LLM({str(tiny_llama)!r}, kv_store={lm_url!r}, kv_role="producer", kv_cache_memory="48MiB")
        llm.generate([{full!r}], SamplingParams(max_tokens=1, temperature=0.0))
        llm.engine.shutdown()
    """)
    env = {**os.environ, "PYTHONHASHSEED": "1", "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=120, capture_output=True)
    config = tmp_path / "lmcache.yaml"
    config.write_text(f"chunk_size: 256\nremote_url: {lm_url!r}\nlocal_cpu: false\nsave_unfull_chunk: true\n")
    consumer = LLM(str(tiny_llama), lmcache_config=str(config), kv_role="consumer", kv_cache_memory="48MiB")
    capture(caplog)
    before = prompt_tokens_computed(consumer)
    out = consumer.generate([full], GREEDY)
    consumer.engine.shutdown()
    assert [lk[3] for lk in lines(caplog, LOOKUP_RE)] == [600]
    assert prompt_tokens_computed(consumer) - before == 1
    assert token_ids(out) == token_ids(mono.generate([full], GREEDY))


def test_lmcache_cache_salts_never_share_chunks(lm_pair, mono, caplog):
    check_salts_never_share(*lm_pair, mono, caplog, seed=5)


def test_a_parallel_layout_is_refused_at_start_up_in_one_line():
    from types import SimpleNamespace

    from pdserve.connectors.lmcache_connector import LMCacheConnector
    from pdserve.engine.config import EngineConfig
    from pdserve.kvstore.layout import KVShard

    config = EngineConfig.from_kwargs("unused", kv_store="lm://127.0.0.1:9")  # nothing listens: refused first
    runner = SimpleNamespace(kv_shard=KVShard.tp_pp(1, 2, 0, 1, 4, 2))
    with pytest.raises(ValueError, match=r"^the LMCache connector serves one process per node \(TP=1, PP=1\), "
                                         r"not 2 ranks: LMCache's keys carry the world size") as err:
        LMCacheConnector(config, runner)
    assert "\n" not in str(err.value)
