"""LoRA adapters through P/D: a prefill node, a decode node and pd-proxy per KV store (file,
redis), every node serving adapters (--enable-lora --lora-modules). Outputs equal HF + PEFT greedy token for
token (fp32) for one adapter and for a batch mixing two adapters and the base model; a prompt under adapter B
after the same prompt under A finds none of A's KV (the nodes' KV lines say so); loads and unloads through the
proxy reach every node while other requests stream, and bad ones are the nodes' 400/404 with nothing disturbed."""
from __future__ import annotations

import json
import random
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pdserve.deploy.processes import NODE_ARGS
from tests.helpers.cluster import log_lines, post, start_cluster
from tests.helpers.lora import completion_ids, stream_token_ids
from tests.helpers.lora_adapters import adapter_set, edit_config, hf_peft_greedy

pytestmark = pytest.mark.slow

MAX_TOKENS = 10
_rng = random.Random(38)
PROMPTS = [[_rng.randrange(3, 259) for _ in range(n)] for n in (9, 100)]
FRESH = [_rng.randrange(3, 259) for _ in range(120)]  # seen under no adapter before the KV-identity test
LORA_ARGS = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "64", "--max-cpu-loras", "4"]


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    return adapter_set(tiny_llama, tmp_path_factory.mktemp("lora-pd"))


@pytest.fixture(scope="module")
def refs(tiny_llama, adapters):
    out = {name: hf_peft_greedy(tiny_llama, adapters[name], PROMPTS, MAX_TOKENS) for name in ("a", "b", "qv")}
    out[None] = hf_peft_greedy(tiny_llama, None, PROMPTS, MAX_TOKENS)
    out["fresh"] = {name: hf_peft_greedy(tiny_llama, adapters[name], [FRESH], MAX_TOKENS)[0] for name in ("a", "b")}
    return out


@pytest.fixture(scope="module", params=["file", "redis"])
def cluster(request, tiny_llama, adapters, tmp_path_factory):
    modules = [f"a={adapters['a']}", json.dumps({"name": "b", "path": str(adapters["b"])})]
    c = start_cluster(tiny_llama, tmp_path_factory.mktemp(f"lora-{request.param}"), store=request.param,
                      node_args=[*NODE_ARGS, *LORA_ARGS, "--lora-modules", *modules])
    c.store_name = request.param
    c.base = httpx.get(c.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    yield c
    codes = c.stop()
    codes.pop(c.store_server.name if c.store_server else "", None)
    assert all(code == 0 for code in codes.values()), codes


def test_models_lists_the_fleet_s_adapters_under_the_base_model(cluster):
    cards = httpx.get(cluster.url + "/v1/models", timeout=10).json()["data"]
    assert [c["id"] for c in cards] == [cluster.base, "a", "b"]
    assert all(c["parent"] == cluster.base for c in cards[1:])


def test_one_adapter_and_a_mixed_batch_equal_hf_peft(cluster, refs):
    assert completion_ids(cluster.url, "a", PROMPTS[0], MAX_TOKENS)[0] == refs["a"][0]
    jobs = [(name, k) for k in range(len(PROMPTS)) for name in ("a", "b", None)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda job: completion_ids(cluster.url, job[0] or cluster.base, PROMPTS[job[1]],
                                                       MAX_TOKENS, f"{cluster.store_name}-mix-{job[0]}-{job[1]}")[0],
                            jobs))
    assert got == [refs[name][k] for name, k in jobs]


def test_b_after_a_loads_none_of_a_s_kv(cluster, refs):
    prompt, s, ref = FRESH, cluster.store_name, refs["fresh"]
    assert completion_ids(cluster.url, "a", prompt, MAX_TOKENS, f"{s}-first-a")[0] == ref["a"]
    ids, cached = completion_ids(cluster.url, "b", prompt, MAX_TOKENS, f"{s}-then-b")
    assert (ids, cached) == (ref["b"], 0)
    prefill_log, decode_log = cluster.prefill[0].log_file, cluster.decode[0].log_file
    prefill_b = log_lines(prefill_log, f"{s}-then-b")
    # The prefill node computed B's whole prompt (A's KV is keyed apart) and stored all of it under B.
    assert any(f"prefill done: {len(prompt)} prompt tokens, 0 cached" in line for line in prefill_b), prefill_b
    assert any(f"Stored {len(prompt)} tokens [0, {len(prompt)})" in line for line in prefill_b), prefill_b
    # Every KV line of B's request, on both nodes, names B: what the decode node loaded is B's own prefill.
    kv_lines = [line for line in prefill_b + log_lines(decode_log, f"{s}-then-b") if "LoRA adapter:" in line]
    assert kv_lines and all("LoRA adapter: b (" in line for line in kv_lines), kv_lines
    again = completion_ids(cluster.url, "a", prompt, MAX_TOKENS, f"{s}-again-a")
    assert again[0] == ref["a"] and again[1] > 0  # A's own KV is found


def test_unknown_adapter_is_vllm_s_404(cluster):
    status, body = post(cluster.url, "/v1/completions", {"model": "nope", "prompt": PROMPTS[0], "max_tokens": 2})
    assert status == 404 and body["error"]["type"] == "NotFoundError", body
    assert "The model `nope` does not exist" in body["error"]["message"] and "b" in body["error"]["message"]


def test_load_unload_through_the_proxy_while_streams_run(cluster, adapters, refs, tiny_llama, tmp_path):
    long_ref = hf_peft_greedy(tiny_llama, adapters["a"], [PROMPTS[1]], 120)[0]
    with ThreadPoolExecutor(1) as pool:
        streaming = pool.submit(stream_token_ids, cluster.url, "a", PROMPTS[1], 120)
        loaded = httpx.post(cluster.url + "/v1/load_lora_adapter", timeout=60,
                            json={"lora_name": "qv", "lora_path": str(adapters["qv"])})
        assert (loaded.status_code, loaded.text) == (200, "Success: LoRA adapter 'qv' added successfully.")
        assert completion_ids(cluster.url, "qv", PROMPTS[0], MAX_TOKENS)[0] == refs["qv"][0]
        bad = {"missing": str(tmp_path / "none"),
               "dora": str(edit_config(shutil.copytree(adapters["a"], tmp_path / "dora"), use_dora=True)),
               "big": str(edit_config(shutil.copytree(adapters["a"], tmp_path / "big"), r=128))}
        for why, path in bad.items():
            status, body = post(cluster.url, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": path})
            assert status == 400 and "on every node" in body["error"]["message"], (why, body)
        status, body = post(cluster.url, "/v1/unload_lora_adapter", {"lora_name": "x"})
        assert status == 404 and "cannot be found" in body["error"]["message"], body
        unloaded = httpx.post(cluster.url + "/v1/unload_lora_adapter", json={"lora_name": "qv"}, timeout=60)
        assert (unloaded.status_code, unloaded.text) == (200, "Success: LoRA adapter 'qv' removed successfully.")
        assert post(cluster.url, "/v1/completions", {"model": "qv", "prompt": PROMPTS[0], "max_tokens": 2})[0] == 404
        assert streaming.result(timeout=300) == long_ref  # the stream under A ran through all of it, exact
    cards = httpx.get(cluster.url + "/v1/models", timeout=10).json()["data"]
    assert [c["id"] for c in cards] == [cluster.base, "a", "b"]  # nothing else disturbed
    assert completion_ids(cluster.url, "b", PROMPTS[0], MAX_TOKENS)[0] == refs["b"][0]
