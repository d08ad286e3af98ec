"""A `kv_both` node (it loads and saves in one engine) under TP: when one rank's load fails, no rank commits
the chunks that step computed over it (engine/parallel/kv_ranks.py shares the failed loads before the saves).

Rank 1's part of the first layer is damaged in every stored chunk (its later layers are then not read). A TP=2 kv_both node then serves longer prompts
that share those prefixes: rank 1's loads fail, rank 0's succeed, and the step's new chunks were computed
over rank 1's missing KV. Had rank 0 committed its part of them, the recompute's saves (rank 1's part only)
would complete those chunks around rank 0's wrong part. Every chunk the node committed must hold what a
clean single-process prefill of the same prompts stores (up to all-reduce rounding).
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from pdserve.kvstore import open_store
from pdserve.serving import SamplingParams
from tests.helpers.parallel import parallel_llm

pytestmark = pytest.mark.timeout(600)

rng = random.Random(7)
SHORT = [[rng.randrange(3, 259) for _ in range(n)] for n in (300, 600)]  # 1 and 2 full chunks of 256 each
LONG = [p + [rng.randrange(3, 259) for _ in range(300)] for p in SHORT]
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0)
LAYERS, KV_HEADS, HEAD_DIM = 4, 2, 32  # the tiny model's


def committed(root: Path) -> tuple[str, set[str]]:
    """(the store's one fingerprint, the keys of its committed chunks)."""
    [fp_dir] = [d for d in root.iterdir() if d.is_dir()]
    return fp_dir.name, {m.parent.name for m in fp_dir.glob("*/*/commit")}


def layer_kv(root: Path, fingerprint: str, key: str, layer: int, parts: bool) -> torch.Tensor:
    store = open_store(root.as_uri(), fingerprint=fingerprint, num_layers=LAYERS, dtype=torch.float32,
                       kv_shape=(KV_HEADS, HEAD_DIM))
    try:
        if not parts:
            return store.get_layer_decoded(layer, [key])[0][0]
        return torch.cat([store.get_layer_decoded(layer, [key], heads=(h, h + 1))[0][0] for h in range(KV_HEADS)],
                         dim=2)
    finally:
        store.close()


@pytest.mark.parametrize("mode", ["async", "layerwise"])
@pytest.mark.slow  # seconds: outside make test-quick
def test_a_kv_both_node_commits_nothing_computed_over_another_ranks_failed_load(tiny_llama, tmp_path, mode):
    store, clean = tmp_path / "store", tmp_path / "clean"
    with parallel_llm(tiny_llama, 2, 1, kv_store=store.as_uri(), kv_role="kv_producer") as llm:
        llm.generate(SHORT, ONE_TOKEN)
    damaged = sorted(store.rglob("0.h1-2.kv"))
    assert len(damaged) == 5  # [0, 256) and a partial chunk of the first prompt, 3 chunks of the second
    for obj in damaged:
        data = obj.read_bytes()
        obj.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    _, before = committed(store)
    with parallel_llm(tiny_llama, 2, 1, kv_store=store.as_uri(), kv_role="kv_both", kv_load_mode=mode) as llm:
        outs = llm.generate(LONG, ONE_TOKEN)
    assert all(o.num_cached_tokens == 0 for o in outs)  # rank 1's loads failed: recomputed
    with parallel_llm(tiny_llama, 1, 1, kv_store=clean.as_uri(), kv_role="kv_producer") as llm:
        llm.generate(LONG, ONE_TOKEN)
    fingerprint, written = committed(store)
    _, reference = committed(clean)
    new = (written - before) & reference
    assert len(new) >= 3  # the long prompts' chunks past the shared prefixes
    for key in sorted(new):
        for layer in range(LAYERS):
            got = layer_kv(store, fingerprint, key, layer, parts=True)
            want = layer_kv(clean, fingerprint, key, layer, parts=False)
            assert torch.allclose(got, want, atol=1e-4), (key, layer, (got - want).abs().max().item())
