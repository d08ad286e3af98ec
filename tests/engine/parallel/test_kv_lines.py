"""The KV lines of a parallel node (engine/parallel/kv_events.py): one load line and one save line per request,
written by rank 0 with every rank's bytes, over a real file store and real rank processes.

With the raw codec a request's bytes do not depend on the layout (each rank moves exactly its own layers and
heads), so every layout's lines and counters must equal tokens x layers x K/V x KV heads x head_dim x 4 bytes,
which is also what one process writes.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pdserve.connectors.kv_hits import parse_line
from pdserve.engine.builtin_model import make_model
from pdserve.serving import SamplingParams
from tests.helpers.parallel import parallel_llm
from tests.helpers.oracles import hf_greedy
from tests.helpers.parallel import HANDOFF_PROMPTS as PROMPTS, handoff_prefill as prefill

PAIRS = {"TP=1 -> TP=1": ((1, 1), (1, 1)), "TP=2 -> TP=2": ((2, 1), (2, 1)), "PP=2 -> PP=2": ((1, 2), (1, 2))}
PARTIAL = re.compile(r"from \d+ of \d+ ranks")  # a line written with some ranks' parts missing
COUNTERS = ("pdserve_kv_save_bytes_total", "pdserve_kv_load_bytes_total", "pdserve_kv_saved_chunks_total")


def bytes_per_token(path: Path) -> int:
    cfg = json.loads((path / "config.json").read_text())
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4  # fp32


def run(path: Path, store: str, layout: tuple[int, int], role: str, max_tokens: int, caplog, capfd):
    """Outputs, every KV line of the node's processes as pd-kv-hits reads them, rank 0's byte counters."""
    caplog.clear()
    capfd.readouterr()
    with parallel_llm(path, *layout, kv_store=store, kv_role=role) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0))
        metrics = llm.engine.connector.metrics
        counters = {name: metrics.value(name) for name in COUNTERS}
    text = caplog.text + capfd.readouterr().err  # rank 0's lines and the other ranks' (their stderr)
    return outs, text, [e for e in map(parse_line, text.splitlines()) if e is not None], counters


def gb(num_bytes: int) -> float:
    return round(num_bytes / 1e9, 4)  # the line's precision


@pytest.mark.parametrize("pair", list(PAIRS))
@pytest.mark.slow  # seconds: outside make test-quick
def test_one_line_per_request_with_the_whole_nodes_bytes(tiny_llama, tmp_path, caplog, capfd, pair):
    caplog.set_level("INFO", logger="pdserve")
    store = (tmp_path / "store").as_uri()
    per_token = bytes_per_token(tiny_llama)
    want = {f"gen-{i}": len(p) * per_token for i, p in enumerate(PROMPTS)}  # every chunk, the partial last too
    prefill_layout, decode_layout = PAIRS[pair]

    _, text, events, counters = run(tiny_llama, store, prefill_layout, "kv_producer", 1, caplog, capfd)
    saves = [e for e in events if e.kind == "save"]
    assert sorted(e.request_id for e in saves) == sorted(want), text[-3000:]
    assert {e.request_id: e.values["gb"] for e in saves} == {rid: gb(n) for rid, n in want.items()}
    assert counters["pdserve_kv_save_bytes_total"] == sum(want.values())
    assert counters["pdserve_kv_saved_chunks_total"] == sum(-(-len(p) // 256) for p in PROMPTS)
    assert not PARTIAL.search(text)

    outs, text, events, counters = run(tiny_llama, store, decode_layout, "kv_consumer", 8, caplog, capfd)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(tiny_llama, PROMPTS, max_tokens=8)
    loads = [e for e in events if e.kind == "load"]
    assert sorted(e.request_id for e in loads) == sorted(want), text[-3000:]
    assert {e.request_id: (e.values["retrieved"], e.values["gb"]) for e in loads} == \
        {f"gen-{i}": (len(p), gb(len(p) * per_token)) for i, p in enumerate(PROMPTS)}
    assert counters["pdserve_kv_load_bytes_total"] == sum(want.values())
    assert not [e for e in events if e.kind == "fallback"]
    assert not PARTIAL.search(text)


@pytest.mark.slow  # seconds: outside make test-quick
def test_a_replica_layouts_save_lines_are_whole(tmp_path, caplog, capfd):
    """One KV head over TP=2: rank 1 replicates rank 0's head and saves nothing (its empty save is no part:
    test_parallel_kv_join.py); the save lines are whole, with the one head's bytes."""
    model = make_model(tmp_path / "one-kv-head", preset="tiny", num_kv_heads=1)
    caplog.set_level("INFO", logger="pdserve")
    _, text, events, counters = run(model, (tmp_path / "store").as_uri(), (2, 1), "kv_producer", 1, caplog, capfd)
    want = {f"gen-{i}": gb(len(p) * bytes_per_token(model)) for i, p in enumerate(PROMPTS)}
    assert {e.request_id: e.values["gb"] for e in events if e.kind == "save"} == want
    assert len([e for e in events if e.kind == "save"]) == len(PROMPTS)
    assert counters["pdserve_kv_save_bytes_total"] == sum(len(p) for p in PROMPTS) * bytes_per_token(model)
    assert not PARTIAL.search(text)


@pytest.mark.slow  # seconds: outside make test-quick
def test_a_load_failing_on_one_rank_writes_no_load_line(tiny_llama, tmp_path, caplog, capfd):
    """Rank 1's part of layer 2 is damaged in every chunk: rank 0's loads succeed, rank 1's fail, so no
    request has a load line (rank 1's warning says why) and rank 0 counts no load bytes."""
    store = tmp_path / "store"
    prefill(tiny_llama, store.as_uri(), (2, 1))
    for obj in sorted(store.rglob("2.h1-2.kv")):
        data = bytearray(obj.read_bytes())
        data[-1] ^= 0xFF
        obj.write_bytes(bytes(data))
    caplog.set_level("INFO", logger="pdserve")
    outs, text, events, counters = run(tiny_llama, store.as_uri(), (2, 1), "kv_consumer", 8, caplog, capfd)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(tiny_llama, PROMPTS, max_tokens=8)
    assert sorted(e.request_id for e in events if e.kind == "fallback") == [f"gen-{i}" for i in range(3)], text[-3000:]
    assert not [e for e in events if e.kind == "load"]
    assert counters["pdserve_kv_load_bytes_total"] == 0
