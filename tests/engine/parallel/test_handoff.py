"""The KV hand-off between layouts: a prefill engine of one (TP, PP) saves, a decode engine of
another loads, over a real file store and a real redis-server; every rank saves and loads only its part
(kvstore/layout.py), rank 0 aggregates the ranks' finished and failed I/O (engine/parallel/kv_ranks.py).

Outputs equal HF's token for token (no divergence tolerated: the tiny models' greedy gaps are far above
all-reduce rounding) and every prompt token but the last is loaded, not recomputed.
"""
from __future__ import annotations

import re

import pytest

from tests.helpers.oracles import hf_greedy
from tests.helpers.parallel import HANDOFF_PROMPTS as PROMPTS, handoff_decode as decode, handoff_prefill as prefill

PAIRS = {"prefill TP=2 -> decode TP=1": ((2, 1), (1, 1)), "prefill TP=1 -> decode PP=2": ((1, 1), (1, 2)),
         "prefill PP=2 -> decode TP=2": ((1, 2), (2, 1))}


@pytest.fixture(scope="module")
def refs(tiny_llama):
    return hf_greedy(tiny_llama, PROMPTS, max_tokens=8)


def kv_lines(text: str, what: str) -> dict[str, int]:
    """Request id -> how many `what` lines (lookup: 'KV hit tokens', load: 'Retrieved') the logs hold."""
    counts: dict[str, int] = {}
    for rid in re.findall(rf"Reqid: (\S+), .*{what}", text):
        counts[rid.rstrip(",")] = counts.get(rid.rstrip(","), 0) + 1
    return counts


@pytest.mark.parametrize("store_kind", ["file", "redis"])
@pytest.mark.parametrize("pair", list(PAIRS))
@pytest.mark.slow  # seconds: outside make test-quick
def test_heterogeneous_pairs_hand_off_exactly(tiny_llama, refs, tmp_path, redis_server, store_kind, pair, caplog,
                                              capfd):
    store = (tmp_path / "store").as_uri() if store_kind == "file" else redis_server.url
    caplog.set_level("INFO", logger="pdserve")
    prefill_layout, decode_layout = PAIRS[pair]
    prefill(tiny_llama, store, prefill_layout)
    caplog.clear()
    capfd.readouterr()
    outs = decode(tiny_llama, store, decode_layout)
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert [o.num_cached_tokens for o in outs] == [len(p) - 1 for p in PROMPTS]  # all loaded, none recomputed
    logs = caplog.text + capfd.readouterr().err  # rank 0's lines and the other ranks' (their stderr)
    ids = [f"gen-{i}" for i in range(len(PROMPTS))]
    assert kv_lines(logs, "KV hit tokens") == dict.fromkeys(ids, 1)
    assert kv_lines(logs, "Retrieved") == dict.fromkeys(ids, 1)


@pytest.mark.slow  # seconds: outside make test-quick
def test_a_load_failing_on_one_rank_makes_rank0_recompute(tiny_llama, refs, tmp_path, caplog, capfd):
    """Rank 1's part of layer 2 is damaged in every chunk: rank 1's loads fail their checksum, rank 0's
    succeed; the requests recompute and the output is still exact."""
    store = tmp_path / "store"
    prefill(tiny_llama, store.as_uri(), (2, 1))
    damaged = sorted(store.rglob("2.h1-2.kv"))
    assert damaged
    for obj in damaged:
        data = bytearray(obj.read_bytes())
        data[-1] ^= 0xFF
        obj.write_bytes(bytes(data))
    caplog.set_level("INFO", logger="pdserve")
    capfd.readouterr()
    outs = decode(tiny_llama, store.as_uri(), (2, 1))
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert all(o.num_cached_tokens == 0 for o in outs)  # recomputed
    err = capfd.readouterr().err  # rank 1 says why, once per request
    assert kv_lines(err, "KV load failed") == {f"gen-{i}": 1 for i in range(len(PROMPTS))}, err[-3000:]
    assert "KV load failed" not in caplog.text  # rank 0's own loads were fine
