"""pd-serve against the official `openai` client and raw HTTP: correctness, streaming, concurrency,
disconnects, request ids, metrics and /health responsiveness, all on one real server process."""
from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
import yaml

from pdserve.deploy.processes import REPO
from pdserve.deploy.server_process import ServerProcess
from pdserve.serving.responses import top_by_text
from tests.helpers.cluster import wait_until
from tests.helpers.serve import open_stream, sse_events
from tests.helpers.oracles import hf_greedy
from tests.helpers.prompts import random_prompt

MAX_TOKENS = 12
# How long /health may take where it matters: the readiness probe of the Kubernetes deployment.
READINESS_TIMEOUT_S = min(
    float(doc["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["timeoutSeconds"])
    for role in ("prefill", "decode")
    for doc in yaml.safe_load_all((REPO / "deploy" / "kubernetes" / f"{role}.yaml").read_text())
    if doc and doc.get("kind") == "StatefulSet")


@pytest.fixture(scope="module")
def server(tiny_llama):
    with ServerProcess("--model", str(tiny_llama), "--dtype", "float32", "--kv-cache-memory", "32MiB") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model_name(server):
    return server.get_json("/v1/models")["data"][0]["id"]


def _complete_ids(client, model_name, prompt, **kw):
    resp = client.completions.create(model=model_name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"return_token_ids": True}, **kw)
    return resp.choices[0].token_ids, resp


@pytest.mark.slow  # seconds: outside make test-quick
def test_openai_client_completion_matches_hf_greedy(tiny_llama, client, model_name):
    prompts = [random_prompt(n, seed=100 + n) for n in (5, 40, 300)]
    refs = hf_greedy(tiny_llama, prompts, MAX_TOKENS)
    for prompt, ref in zip(prompts, refs):
        ids, resp = _complete_ids(client, model_name, prompt)
        assert ids == ref
        assert resp.usage.prompt_tokens == len(prompt)
        assert resp.usage.completion_tokens == len(ref)
        assert resp.choices[0].finish_reason == ("stop" if ref[-1] == 1 else "length")
    # The same prompt again comes from the prefix cache: reported as cached tokens, same output.
    ids, resp = _complete_ids(client, model_name, prompts[2])
    assert ids == refs[2]
    assert resp.usage.prompt_tokens_details.cached_tokens == 288  # 18 full blocks of 16


@pytest.mark.slow  # seconds: outside make test-quick
def test_streamed_text_concatenates_to_non_streamed(client, model_name):
    prompt = "The quick brown fox jumps over the lazy dog. " * 3
    full = client.completions.create(model=model_name, prompt=prompt, max_tokens=40, temperature=0)
    stream = client.completions.create(model=model_name, prompt=prompt, max_tokens=40, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text and text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason


@pytest.mark.slow  # seconds: outside make test-quick
def test_chat_stream_and_non_stream_agree(client, model_name):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]
    full = client.chat.completions.create(model=model_name, messages=messages, max_tokens=30, temperature=0)
    assert full.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=model_name, messages=messages, max_tokens=30, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens > 0


def test_chat_uses_the_chat_template(tiny_llama, client, model_name):
    from pdserve.engine.tokenizer import apply_chat_template, load_tokenizer

    messages = [{"role": "user", "content": "hello there"}]
    expected = apply_chat_template(load_tokenizer(tiny_llama), messages)
    resp = client.chat.completions.create(model=model_name, messages=messages, max_tokens=MAX_TOKENS,
                                          temperature=0, extra_body={"return_token_ids": True})
    assert resp.usage.prompt_tokens == len(expected)
    ids, _ = _complete_ids(client, model_name, expected)  # same tokens through /v1/completions
    assert resp.choices[0].token_ids == ids


def test_sampled_token_logprobs(client, model_name):
    resp = client.completions.create(model=model_name, prompt="abc", max_tokens=6, temperature=0, logprobs=0,
                                     extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert len(lp.token_logprobs) == 6 and all(x <= 0 for x in lp.token_logprobs)
    # logprobs=0: vLLM's one entry per position, the sampled token
    assert [list(top.items()) for top in lp.top_logprobs] == [[p] for p in zip(lp.tokens, lp.token_logprobs)]
    chat = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "abc"}],
                                          max_tokens=6, temperature=0, logprobs=True,
                                          extra_body={"ignore_eos": True})
    assert len(chat.choices[0].logprobs.content) == 6
    assert all(c.top_logprobs == [] for c in chat.choices[0].logprobs.content)


def _hf_top(model_path, prompt_ids: list[int], output_ids: list[int], k: int) -> list[list[tuple[str, float]]]:
    """HF's k best (token text, logprob) at each generated position: log_softmax of its raw fp32 logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(model_path))
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_ids + output_ids[:-1]])).logits[0, len(prompt_ids) - 1:]
    values, ids = torch.log_softmax(logits.float(), -1).topk(k, -1)
    return [[(tok.decode([t]), v) for t, v in zip(i.tolist(), v.tolist())] for i, v in zip(ids, values)]


def _assert_top_matches_hf(got: list[list[tuple[str, float]]], tokens: list[str], logprobs: list[float], hf):
    assert len(got) == len(tokens) == len(logprobs) == len(hf) > 0
    for top, token, logprob, ref in zip(got, tokens, logprobs, hf):
        values = [lp for _, lp in top]
        assert values == sorted(values, reverse=True)
        assert top[0] == (token, logprob)  # greedy: the sampled token is the most likely one
        best, ref_best = top_by_text(top), top_by_text(ref)
        assert best.keys() == ref_best.keys()
        assert [best[t] for t in ref_best] == pytest.approx(list(ref_best.values()), abs=1e-4)


def test_completion_top_logprobs_match_hf_streaming_and_not(tiny_llama, client, model_name):
    prompt = random_prompt(30, seed=31)
    kw = dict(model=model_name, prompt=prompt, max_tokens=6, temperature=0, logprobs=3,
              extra_body={"return_token_ids": True, "ignore_eos": True})
    # Each call under its own cache_salt: both compute the whole prompt (no prefix-cache hit for the second), so
    # their figures come from the same arithmetic on any CPU kind, not from a 30-row and a 14-row prefill.
    body = kw.pop("extra_body")
    choice = client.completions.create(**kw, extra_body={**body, "cache_salt": "plain"}).choices[0]
    kw["extra_body"] = {**body, "cache_salt": "streamed"}
    lp = choice.logprobs
    assert all(len(top) <= 3 for top in lp.top_logprobs)  # token texts are keys: equal texts merge
    got = [list(top.items()) for top in lp.top_logprobs]  # JSON object order: best first
    _assert_top_matches_hf(got, lp.tokens, lp.token_logprobs, _hf_top(tiny_llama, prompt, choice.token_ids, 3))
    chunks = [c.choices[0].logprobs for c in client.completions.create(**kw, stream=True) if c.choices[0].logprobs]
    assert [t for c in chunks for t in c.tokens] == lp.tokens
    assert [x for c in chunks for x in c.token_logprobs] == lp.token_logprobs
    assert [x for c in chunks for x in c.top_logprobs] == lp.top_logprobs
    assert [x for c in chunks for x in c.text_offset] == lp.text_offset


def test_chat_top_logprobs_match_hf_streaming_and_not(tiny_llama, client, model_name):
    kw = dict(model=model_name, messages=[{"role": "user", "content": "Count: one two"}], max_tokens=6,
              temperature=0, logprobs=True, top_logprobs=3, extra_body={"return_token_ids": True, "ignore_eos": True})
    body = kw.pop("extra_body")  # each call under its own cache_salt: no shared prefix, the same arithmetic
    resp = client.chat.completions.create(**kw, extra_body={**body, "cache_salt": "plain"})
    kw["extra_body"] = {**body, "cache_salt": "streamed"}
    content = resp.choices[0].logprobs.content
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].bytes == list(c.top_logprobs[0].token.encode())
               for c in content)
    got = [[(t.token, t.logprob) for t in c.top_logprobs] for c in content]
    hf = _hf_top(tiny_llama, resp.prompt_token_ids, resp.choices[0].token_ids, 3)
    _assert_top_matches_hf(got, [c.token for c in content], [c.logprob for c in content], hf)
    streamed = [e for c in client.chat.completions.create(**kw, stream=True)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]


def test_seeded_sampling_is_reproducible(client, model_name):
    kw = dict(model=model_name, prompt="seed test", max_tokens=16, temperature=1.0, top_p=0.9,
              extra_body={"top_k": 50, "ignore_eos": True, "return_token_ids": True})
    a = client.completions.create(seed=7, **kw).choices[0].token_ids
    b = client.completions.create(seed=7, **kw).choices[0].token_ids
    c = client.completions.create(seed=8, **kw).choices[0].token_ids
    assert a == b and a != c


@pytest.mark.slow
def test_32_concurrent_streams_get_their_own_output(tiny_llama, server, client, model_name):
    rng = random.Random(5)
    prompts = [random_prompt(rng.randrange(1, 200), seed=1000 + i) for i in range(32)]
    # Reference: each prompt alone (non-streamed, one at a time); two of them also checked against HF.
    alone = [_complete_ids(client, model_name, p)[0] for p in prompts]
    assert hf_greedy(tiny_llama, prompts[:2], MAX_TOKENS) == alone[:2]

    def stream(i: int) -> list[int]:
        status, _, body = server.request("POST", "/v1/completions", {
            "model": model_name, "prompt": prompts[i], "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True, "return_token_ids": True}, headers={"X-Request-Id": f"conc-{i}"})
        assert status == 200, body
        events = sse_events(body.splitlines())
        assert events[-1] == "[DONE]" and all(e["id"] == f"cmpl-conc-{i}" for e in events[:-1])
        return [t for e in events[:-1] for t in e["choices"][0]["token_ids"]]

    with ThreadPoolExecutor(32) as pool:
        outs = list(pool.map(stream, range(32)))
    assert outs == alone


def test_request_id_echoed_and_logged(server, model_name):
    status, headers, _ = server.request("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2},
                                        headers={"X-Request-Id": "my-req-42"})
    assert status == 200 and headers["X-Request-Id"] == "my-req-42"
    status, headers, _ = server.request("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    generated = headers["X-Request-Id"]
    assert status == 200 and len(generated) >= 16
    for rid in ("my-req-42", generated):  # (a log line may land a little after the answer)
        lines = wait_until(lambda: _log_lines(server, rid) if len(_log_lines(server, rid)) >= 2 else None,
                           f"two log lines of {rid}")
        assert all(f"Reqid: {rid}," in ln for ln in lines), lines


def _log_lines(server: ServerProcess, needle: str) -> list[str]:
    return [ln for ln in server.log.splitlines() if needle in ln]


def test_client_disconnect_mid_stream_frees_blocks(server, model_name):
    total = server.get_json("/stats")["num_total_blocks"]
    resp = open_stream(server, {"prompt": random_prompt(500, seed=3), "max_tokens": 5000, "stream": True,
                                 "ignore_eos": True, "temperature": 0}, "disconnect-me")
    for _ in range(3):
        assert resp.readline().startswith(b"data: {")
        resp.readline()
    busy = server.wait_for(lambda s: s["num_running"] == 1, "the request to run")
    assert busy["num_free_blocks"] < total
    resp.close()  # drop the connection mid-stream
    server.wait_for(lambda s: s["num_running"] == 0 and s["num_waiting"] == 0 and s["num_in_flight"] == 0
                    and s["num_free_blocks"] == total, "the aborted request's blocks to be freed")
    wait_until(lambda: "Reqid: disconnect-me, aborted" in server.log, "the abort's log line")
    assert 'outcome="abort"} 1.0' in server.request("GET", "/metrics")[2].decode()


def test_health_answers_during_long_prefill(server, model_name):
    prompt = random_prompt(4096, seed=4)
    done = threading.Event()
    threading.Thread(target=lambda: (server.request("POST", "/v1/completions",
                                                    {"prompt": prompt, "max_tokens": 1}), done.set()),
                     daemon=True).start()
    before = server.wait_for(lambda s: s["step_running_s"] is not None and s["num_in_flight"] == 1,
                             "the prefill step to start")
    t0 = time.monotonic()
    status, _, body = server.request("GET", "/health")
    latency = time.monotonic() - t0
    after = server.get_json("/stats")
    assert status == 200 and json.loads(body)["status"] == "ok"
    # The same prefill step was running before and after the health check: it answered mid-step.
    assert after["num_steps"] == before["num_steps"] and after["step_running_s"] is not None
    # So it did not wait for the step. How long it took is a matter of the machine; the bound is the one a
    # deployment holds it to (deploy/kubernetes/*.yaml: readinessProbe timeoutSeconds).
    assert latency < READINESS_TIMEOUT_S, f"/health took {latency * 1e3:.0f} ms during a prefill"
    assert done.wait(60)


def test_metrics_exposition(server):
    text = server.request("GET", "/metrics")[2].decode()
    for name in ("pdserve_requests_total", "pdserve_time_to_first_token_seconds_bucket",
                 "pdserve_inter_token_latency_seconds_bucket", "pdserve_num_requests_running",
                 "pdserve_num_requests_waiting", "pdserve_kv_cache_usage_ratio", "pdserve_prefix_cache_hits_tokens"):
        assert name in text
    hits = [ln for ln in text.splitlines() if ln.startswith("pdserve_prefix_cache_hits_tokens")]
    assert float(hits[0].split()[-1]) > 0  # earlier tests repeated prompts


def test_models_endpoint(server, tiny_llama):
    models = server.get_json("/v1/models")
    assert models["object"] == "list" and models["data"][0]["id"] == tiny_llama.name
    assert models["data"][0]["max_model_len"] == 8192


def test_cache_salt_isolates_prefix_cache(client, model_name):
    prompt = random_prompt(64, seed=77)

    def cached(salt):
        extra = {"cache_salt": salt} if salt else {}
        resp = client.completions.create(model=model_name, prompt=prompt, max_tokens=2, extra_body=extra)
        return resp.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") == 48  # 3 full blocks of 16; the last prompt token is always computed
    assert cached("tenant-b") == 0
    assert cached(None) == 0


def test_reset_prefix_cache_forgets_earlier_prompts(server, client, model_name):
    """vLLM's POST /reset_prefix_cache (aiperf's --reset-kv-cache): 200, and the next request finds nothing of
    the earlier ones in the prefix cache, while a request in flight finishes unharmed."""
    prompt = random_prompt(100, seed=4040)

    def cached() -> int:
        return _complete_ids(client, model_name, prompt)[1].usage.prompt_tokens_details.cached_tokens

    assert cached() == 0 and cached() == 96  # 6 full blocks of 16, the last token always computed
    stream = open_stream(server, {"model": model_name, "prompt": random_prompt(50, seed=4041), "max_tokens": 32,
                                  "ignore_eos": True, "stream": True}, "reset-meanwhile")
    status, _, body = server.request("POST", "/reset_prefix_cache")
    assert status == 200 and body == b""
    events = sse_events(stream)
    assert events[-1] == "[DONE]" and sum(len(e["choices"][0]["text"]) > 0 for e in events[:-1]) > 0
    assert cached() == 0 and cached() == 96  # cached again from the request after the reset
