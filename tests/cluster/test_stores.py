"""One prefill node, one decode node and pd-proxy per KV store (file, Redis, LMCache server), driven
with the official openai client: outputs equal pd-serve and HF generate, the decode log shows the
hit and load lines, pd-kv-hits reads the real logs, and bad input gets pd-serve's exact errors."""
from __future__ import annotations

import urllib.request

import httpx
import pytest

from pdserve.deploy.processes import CHUNK_SIZE, NODE_ARGS
from pdserve.deploy.server_process import ServerProcess
from tests.helpers.cluster import client, kv_hits, log_lines, post, start_cluster
from tests.helpers.oracles import hf_greedy
from tests.helpers.prompts import random_prompt
from tests.helpers.bad_requests import BAD_CHATS, BAD_COMPLETIONS

pytestmark = pytest.mark.slow

MAX_TOKENS = 10
PROMPTS = [random_prompt(n, seed=700 + n) for n in (40, 150, 300)]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours. " * 4}]


@pytest.fixture(scope="module")
def hf_refs(tiny_llama):
    return hf_greedy(tiny_llama, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def pd_serve(tiny_llama):
    engine_args = NODE_ARGS[:NODE_ARGS.index("--chunk-size")]
    with ServerProcess("--model", str(tiny_llama), *engine_args) as srv:
        yield srv


@pytest.fixture(scope="module", params=["file", "redis", "lmcache"])
def cluster(request, tiny_llama, tmp_path_factory):
    c = start_cluster(tiny_llama, tmp_path_factory.mktemp(f"cluster-{request.param}"), store=request.param)
    c.store_name = request.param
    yield c
    codes = c.stop()
    codes.pop(c.store_server.name if c.store_server else "", None)  # redis/LMCache servers: not ours
    assert all(code == 0 for code in codes.values()), codes  # nodes and proxy shut down cleanly


def _ids(cl, prompt, rid, salt: str | None = None, **kw):
    body = {"return_token_ids": True, **({"cache_salt": salt} if salt else {})}
    resp = cl.completions.create(model=cl.model_name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                 extra_body=body, extra_headers={"X-Request-Id": rid}, **kw)
    return resp.choices[0].token_ids, resp


def test_completions_match_pd_serve_and_hf(cluster, pd_serve, hf_refs):
    proxy, mono = client(cluster.url), client(pd_serve.url)
    proxy.model_name = mono.model_name = mono.models.list().data[0].id
    assert proxy.models.list().data[0].id == proxy.model_name
    for i, (prompt, ref) in enumerate(zip(PROMPTS, hf_refs)):
        rid = f"{cluster.store_name}-cmpl-{i}"
        # one cache salt per store: pd-serve (shared by the three clusters) and this cluster have seen the same
        # earlier requests under it, so their cached_tokens must agree
        ids, resp = _ids(proxy, prompt, rid, salt=cluster.store_name)
        mono_ids, mono_resp = _ids(mono, prompt, rid, salt=cluster.store_name)
        assert ids == ref == mono_ids
        assert resp.id == "cmpl-" + rid and resp.usage.prompt_tokens == len(prompt)
        # cached: earlier requests' KV only, as pd-serve counts it; the decode node loaded every prompt token of
        # this request's own prefill (test_decode_log_shows_hit_and_load...), which is no cache hit
        assert resp.usage.prompt_tokens_details.cached_tokens == mono_resp.usage.prompt_tokens_details.cached_tokens
        streamed = proxy.completions.create(model=proxy.model_name, prompt=prompt, max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in streamed) == resp.choices[0].text
    text = "The quick brown fox jumps over the lazy dog. " * 6
    a = proxy.completions.create(model=proxy.model_name, prompt=text, max_tokens=MAX_TOKENS, temperature=0)
    b = mono.completions.create(model=mono.model_name, prompt=text, max_tokens=MAX_TOKENS, temperature=0)
    assert a.choices[0].text == b.choices[0].text and a.usage.prompt_tokens == b.usage.prompt_tokens


def test_chat_matches_pd_serve_streaming_and_not(cluster, pd_serve):
    proxy, mono = client(cluster.url), client(pd_serve.url)
    name = mono.models.list().data[0].id
    kw = dict(model=name, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    a = proxy.chat.completions.create(**kw, extra_headers={"X-Request-Id": f"{cluster.store_name}-chat"})
    b = mono.chat.completions.create(**kw)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert (a.usage.prompt_tokens, a.usage.completion_tokens) == (b.usage.prompt_tokens, b.usage.completion_tokens)
    chunks = list(proxy.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == a.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == a.usage.prompt_tokens


def _split(obj, values=None):
    """(obj with every float replaced by None, the floats in order): compares JSON bodies up to fp noise."""
    values = [] if values is None else values
    if isinstance(obj, float):
        values.append(obj)
        return None, values
    if isinstance(obj, dict):
        return {k: _split(v, values)[0] for k, v in obj.items()}, values
    if isinstance(obj, list):
        return [_split(v, values)[0] for v in obj], values
    return obj, values


def test_top_logprobs_bodies_match_pd_serve(cluster, pd_serve):
    cases = [("/v1/completions", {"prompt": PROMPTS[0], "logprobs": 3}),
             ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 3})]
    for path, body in cases:
        body = {**body, "max_tokens": 4, "temperature": 0}
        (code, got), (_, want) = post(cluster.url, path, body), post(pd_serve.url, path, body)
        (shape, values), (want_shape, want_values) = _split(got["choices"][0]), _split(want["choices"][0])
        assert code == 200 and shape == want_shape  # same tokens, texts, offsets and layout
        assert values == pytest.approx(want_values, abs=1e-4)  # the KV came from another process's forward
        lp = got["choices"][0]["logprobs"]
        tops = lp["top_logprobs"] if path == "/v1/completions" else [c["top_logprobs"] for c in lp["content"]]
        assert len(tops) == 4 and all(1 <= len(top) <= 3 for top in tops)


def test_decode_log_shows_hit_and_load_and_kv_hits_reports_it(cluster):
    prefill_log, decode_log = cluster.prefill[0].log_file, cluster.decode[0].log_file
    rids = [f"{cluster.store_name}-cmpl-{i}" for i in range(len(PROMPTS))]
    for rid, prompt in zip(rids, PROMPTS):
        lines = log_lines(decode_log, rid)
        assert any(f"Total tokens {len(prompt)}, Local computed tokens: 0, KV hit tokens:" in s for s in lines), lines
        assert any("Retrieved" in s and "GB/s" in s for s in lines), lines
        assert any("Stored" in s for s in log_lines(prefill_log, rid))
        assert any("prefill done" in s for s in log_lines(prefill_log, rid))  # one id across the nodes
        assert any("decoding on" in s for s in log_lines(cluster.proxy.out_path, rid))  # ... and the proxy
    report = kv_hits(prefill_log, decode_log)
    rows = {r["request_id"]: r for r in report["requests"]}
    for rid, prompt in zip(rids, PROMPTS):
        r = rows[rid]
        assert r["total_tokens"] == len(prompt) and r["fallback"] is None
        assert r["hit_tokens"] >= len(prompt) // CHUNK_SIZE * CHUNK_SIZE and r["hit_tokens"] > 0
        assert r["need_to_load"] == min(r["hit_tokens"], len(prompt)) == r["loaded"]
        assert r["retrieved"] >= r["need_to_load"] and r["stored"] > 0 and r["load_gbps"] > 0
    s = report["summary"]
    assert s["fallbacks"] == 0 and s["loaded_tokens"] > 0 and s["hit_rate"] > 0.5
    # The same facts as Prometheus counters on the nodes' /metrics.
    decode_metrics = metric_values(f"http://127.0.0.1:{cluster.decode[0].http_port}/metrics")
    prefill_metrics = metric_values(f"http://127.0.0.1:{cluster.prefill[0].http_port}/metrics")
    assert decode_metrics["pdserve_kv_loaded_tokens_total"] >= sum(r["loaded"] for r in rows.values() if r["loaded"])
    assert prefill_metrics["pdserve_kv_saved_tokens_total"] > 0
    # Requests that came over gRPC are counted by outcome too (the prefill half ends at max_tokens=1).
    assert sum(v for k, v in decode_metrics.items() if k.startswith("pdserve_requests_total{")) >= len(PROMPTS)
    assert sum(v for k, v in prefill_metrics.items()
               if k.startswith("pdserve_requests_total{") and 'outcome="length"' in k) >= len(PROMPTS)


def metric_values(url: str) -> dict[str, float]:
    """Samples of a Prometheus text page, labelled ones keyed with their labels."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


@pytest.mark.parametrize("path,cases", [("/v1/completions", BAD_COMPLETIONS), ("/v1/chat/completions", BAD_CHATS)])
def test_bad_input_gets_pd_serve_errors(cluster, pd_serve, path, cases):
    for body, _, _ in cases:
        got, want = post(cluster.url, path, body), post(pd_serve.url, path, body)
        assert got == want, (body, got, want)
    unknown = {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    assert post(cluster.url, path, {**unknown, "model": "gpt-9"}) == post(pd_serve.url, path,
                                                                           {**unknown, "model": "gpt-9"})


def test_bad_request_id_route_and_method_get_pd_serve_errors(cluster, pd_serve):
    def get(url, path):
        r = httpx.get(url + path, timeout=30)
        return r.status_code, r.json()

    assert post(cluster.url, "/v1/completions", {"prompt": "x"}, {"X-Request-Id": "a" * 200}) == \
        post(pd_serve.url, "/v1/completions", {"prompt": "x"}, {"X-Request-Id": "a" * 200})
    for path in ("/v1/nothing", "/v1/completions"):
        assert get(cluster.url, path) == get(pd_serve.url, path)
