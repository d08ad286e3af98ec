"""LoRA through a real pd-serve process: --lora-modules (both forms), the request's `model` picking the
adapter, /v1/models, vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter with their status codes, a
load and an unload while a stream under an adapter runs; outputs against HF + PEFT greedy (fp32)."""
from __future__ import annotations

import json
import random
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve.deploy.server_process import ServerProcess
from tests.helpers.lora_adapters import adapter_set, edit_config, hf_peft_greedy
from tests.helpers.serve import open_stream, sse_events

MAX_TOKENS = 10
_rng = random.Random(77)
PROMPTS = [[_rng.randrange(3, 259) for _ in range(n)] for n in (9, 100)]


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    return adapter_set(tiny_llama, tmp_path_factory.mktemp("lora-serve"))


@pytest.fixture(scope="module")
def refs(tiny_llama, adapters):
    out = {name: hf_peft_greedy(tiny_llama, path, PROMPTS, MAX_TOKENS) for name, path in adapters.items()}
    out[None] = hf_peft_greedy(tiny_llama, None, PROMPTS, MAX_TOKENS)
    return out


@pytest.fixture(scope="module")
def server(tiny_llama, adapters):
    qv = json.dumps({"name": "qv", "path": str(adapters["qv"])})
    with ServerProcess("--model", str(tiny_llama), "--dtype", "float32", "--kv-cache-memory", "32MiB",
                       "--served-model-name", "tiny", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "64",
                       "--max-cpu-loras", "4", "--lora-modules", f"a={adapters['a']}", qv) as srv:
        yield srv


def complete(server, model: str, prompt: list[int], **extra) -> tuple[int, dict]:
    status, _, body = server.request("POST", "/v1/completions", {
        "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True,
        **extra})
    return status, json.loads(body)


def ids(server, model: str, prompt: list[int]) -> tuple[list[int], int]:
    status, body = complete(server, model, prompt)
    assert status == 200, body
    return body["choices"][0]["token_ids"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def post(server, path: str, body: dict) -> tuple[int, str]:
    status, _, raw = server.request("POST", path, body)
    return status, raw.decode()


def test_models_lists_the_adapters_under_the_base_model(server, adapters):
    cards = server.get_json("/v1/models")["data"]
    assert [c["id"] for c in cards] == ["tiny", "a", "qv"]
    assert [(c.get("parent"), c.get("root")) for c in cards[1:]] == [("tiny", str(adapters["a"])),
                                                                    ("tiny", str(adapters["qv"]))]


def test_the_model_field_picks_the_adapter_in_one_batch(server, refs):
    names = ["a", "qv", "tiny"] * 2
    jobs = [(n, k) for k in range(len(PROMPTS)) for n in names]
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda job: ids(server, job[0], PROMPTS[job[1]])[0], jobs))
    assert got == [refs[None if n == "tiny" else n][k] for n, k in jobs]


def test_an_adapter_never_finds_another_s_kv(server, refs):
    server.request("POST", "/reset_prefix_cache")
    assert ids(server, "a", PROMPTS[1]) == (refs["a"][1], 0)
    assert ids(server, "qv", PROMPTS[1]) == (refs["qv"][1], 0)
    assert ids(server, "tiny", PROMPTS[1]) == (refs[None][1], 0)
    assert ids(server, "a", PROMPTS[1]) == (refs["a"][1], 96)  # its own KV: 6 full blocks


def test_unknown_models_and_bad_adapter_calls_are_vllm_s_errors(server, adapters, tmp_path):
    status, body = complete(server, "nope", PROMPTS[0])
    assert status == 404 and body["error"]["type"] == "NotFoundError"
    assert "The model `nope` does not exist" in body["error"]["message"] and "qv" in body["error"]["message"]
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(adapters["b"])})[0] == 400
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "x"})[0] == 400
    missing = post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path / "none")})
    assert missing[0] == 400 and "does not exist" in missing[1]
    dora = edit_config(shutil.copytree(adapters["a"], tmp_path / "dora"), use_dora=True)
    refused = post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(dora)})
    assert refused[0] == 400 and "DoRA" in refused[1]
    big = edit_config(shutil.copytree(adapters["a"], tmp_path / "big"), r=128)
    too_big = post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(big)})
    assert too_big[0] == 400 and "max_lora_rank=64" in too_big[1]
    gone = post(server, "/v1/unload_lora_adapter", {"lora_name": "x"})
    assert gone[0] == 404 and "cannot be found" in gone[1]
    assert [c["id"] for c in server.get_json("/v1/models")["data"]] == ["tiny", "a", "qv"]  # nothing disturbed


def test_load_and_unload_while_a_stream_runs(server, adapters, refs, tiny_llama):
    long_ref = hf_peft_greedy(tiny_llama, adapters["a"], [PROMPTS[1]], 200)[0]
    stream = open_stream(server, {"model": "a", "prompt": PROMPTS[1], "max_tokens": 200, "temperature": 0,
                                  "stream": True, "return_token_ids": True, "ignore_eos": True}, "lora-stream")
    first = stream.readline()
    loaded = post(server, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(adapters["b"])})
    assert loaded == (200, "Success: LoRA adapter 'b' added successfully.")
    assert ids(server, "b", PROMPTS[0])[0] == refs["b"][0]
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "a"}) == (
        200, "Success: LoRA adapter 'a' removed successfully.")
    assert complete(server, "a", PROMPTS[0])[0] == 404  # no longer served ...
    events = sse_events([first, *stream.readlines()])
    streamed = [t for e in events[:-1] for c in e["choices"] for t in c.get("token_ids") or []]
    assert streamed == long_ref[:len(streamed)] and len(streamed) == 200  # ... while its stream finished under it
    log = server.log
    assert log.index("Reqid: lora-stream, finished") > log.index(") unloaded (id 1)")  # it ran past the unload
    # the name again, for other weights: other KV keys, other output
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(adapters["a2"])})[0] == 200
    assert ids(server, "a", PROMPTS[1]) == (refs["a2"][1], 0)
