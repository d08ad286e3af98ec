"""`heads_per_object` through the engines: a prefill TP=1 that stores 1-head objects hands off to a decode TP=2 whose
ranks each read only their own head's objects, exactly (HF's tokens), moving half the bytes of the same load from a
store written without the option; a load of the unsplit store says once per rank process what it moves for nothing.
"""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

from pdserve.connectors import decoded_loads
from pdserve.kvstore.object_format import HEADER_SIZE
from pdserve.serving import SamplingParams
from tests.helpers.parallel import parallel_llm
from tests.helpers.oracles import hf_greedy
from tests.helpers.parallel import HANDOFF_PROMPTS as PROMPTS, handoff_prefill as prefill

pytestmark = pytest.mark.timeout(300)

CHUNK = 256  # the engine's default chunk_size
WIDE = "KV store objects hold KV heads [0, 2) of 2 where this rank keeps [{}, {}): loads move 2.0x the bytes they " \
       "keep; store with heads_per_object=1 on the writer"


def _decode(model: Path, store: str) -> tuple[list, int]:
    """Decode TP=2 (each rank one of the tiny model's 2 KV heads): the outputs, and the bytes rank 0's store read."""
    with parallel_llm(model, 2, 1, kv_store=store, kv_role="kv_consumer") as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0))
        return outs, llm.engine.connector.store.stats().bytes_read


@pytest.mark.slow  # seconds: outside make test-quick
def test_prefill_tp1_split_per_head_hands_off_to_decode_tp2_at_half_the_bytes(tiny_llama, tmp_path, caplog, capfd,
                                                                             monkeypatch):
    refs = hf_greedy(tiny_llama, PROMPTS, max_tokens=8)
    monkeypatch.setattr(decoded_loads, "_WIDE_READS", type(decoded_loads._WIDE_READS)())  # rank 0 is this process
    caplog.set_level(logging.INFO, logger="pdserve")
    read = {}
    for k in (1, 0):
        store = f"{(tmp_path / f'k{k}').as_uri()}?heads_per_object={k}"
        prefill(tiny_llama, store, (1, 1))
        caplog.clear()
        capfd.readouterr()
        outs, read[k] = _decode(tiny_llama, store)
        assert [o.outputs[0].token_ids for o in outs] == refs, k
        assert [o.num_cached_tokens for o in outs] == [len(p) - 1 for p in PROMPTS], k  # all loaded
        rank0 = [r.getMessage() for r in caplog.records if "loads move" in r.getMessage()]
        rank1 = capfd.readouterr().err.count(WIDE.format(1, 2))  # the other rank's lines: its stderr
        assert (rank0, rank1) == (([WIDE.format(0, 1)], 1) if k == 0 else ([], 0)), k
    objects = 4 * sum(-(-len(p) // CHUNK) for p in PROMPTS)  # rank 0 reads one object per chunk and layer either way
    assert read[0] - objects * HEADER_SIZE == 2 * (read[1] - objects * HEADER_SIZE)
    split = sorted(p.name for p in next((tmp_path / "k1").rglob("commit")).parent.iterdir())
    assert split == sorted(["commit", *(f"{layer}.h{h}-{h + 1}.kv" for layer in range(4) for h in (0, 1))])
