"""What pd-proxy tells its clients, against one prefill node, one decode node and a file store (real
processes): usage's cached_tokens counts only KV of earlier requests, /health is 503 until a node of each
role is ready, POST /reset_prefix_cache reaches every node, /metrics has pd-serve's request families with
the proxy's own counts, admission control answers OpenAI's 429 with Retry-After, and a prefill node whose save
failed does not log its KV as committed."""
from __future__ import annotations

import shutil
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.deploy.processes import HOST, Child, free_port, python_module
from tests.helpers.prompts import random_prompt
from tests.helpers.cluster import client, extra_proxy, log_lines, start_cluster, status, wait_until

pytestmark = pytest.mark.slow

# pd-serve's request families (serving/metrics.py RequestMetrics): what a client scraping either finds
REQUEST_FAMILIES = {"pdserve_requests", "pdserve_time_to_first_token_seconds", "pdserve_inter_token_latency_seconds",
                    "pdserve_e2e_request_latency_seconds", "pdserve_prompt_tokens", "pdserve_generation_tokens"}


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory):
    c = start_cluster(tiny_llama, tmp_path_factory.mktemp("proxy-vllm"))
    c.model_name = client(c.url).models.list().data[0].id
    yield c
    c.stop()


@pytest.fixture(scope="module")
def lone_proxy(cluster):
    """A proxy whose prefill node never comes up (nothing listens on its port), over the cluster's decode node."""
    port = free_port()
    child = Child("proxy-no-prefill", python_module(
        "pdserve.proxy", "--port", str(port), "--health-interval", "0.3", "--prefill", f"{HOST}:{free_port()}",
        "--decode", cluster.decode[0].grpc_address), cluster.spec.log_dir)
    child.start()
    url = f"http://{HOST}:{port}"
    wait_until(lambda: _healthy(url, "decode"), "the lone proxy's decode node in rotation", 60)
    yield url
    child.stop()


def _healthy(url: str, role: str) -> bool:
    try:
        return all(n["healthy"] for n in status(url)[role])
    except (httpx.HTTPError, ValueError):
        return False


def _usage(url: str, model: str, prompt: list[int], rid: str):
    resp = client(url).completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0,
                                          extra_body={"ignore_eos": True}, extra_headers={"X-Request-Id": rid})
    return resp.usage


def test_cached_tokens_count_only_earlier_requests_kv(cluster):
    """A prompt never seen before: 0 cached, as pd-serve says, although the decode node loaded all of it from the
    store (the hand-off of this request's own prefill); asked again, the prefill node's prefix-cache hit."""
    prompt = random_prompt(100, seed=4050)
    first = _usage(cluster.url, cluster.model_name, prompt, "cached-1")
    assert (first.prompt_tokens, first.prompt_tokens_details.cached_tokens) == (100, 0)
    loaded = log_lines(cluster.decode[0].log_file, "cached-1")
    assert any("KV hit tokens: 100, need to load: 100" in line for line in loaded), loaded  # the hand-off
    again = _usage(cluster.url, cluster.model_name, prompt, "cached-2")
    assert again.prompt_tokens_details.cached_tokens == 96  # 6 full blocks of 16; the last token is computed
    chunks = list(client(cluster.url).completions.create(model=cluster.model_name, prompt=random_prompt(60, seed=4051),
                                                         max_tokens=2, stream=True,
                                                         stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0


def test_health_is_503_until_a_prefill_node_is_ready(cluster, lone_proxy):
    r = httpx.get(lone_proxy + "/health", timeout=10)
    assert r.status_code == 503 and r.json() == {"status": "unavailable", "prefill": 0, "decode": 1}
    r = httpx.get(cluster.url + "/health", timeout=10)
    assert r.status_code == 200 and r.json() == {"status": "ok", "prefill": 1, "decode": 1}


def test_reset_prefix_cache_reaches_every_node(cluster, lone_proxy):
    prompt = random_prompt(100, seed=4060)
    _usage(cluster.url, cluster.model_name, prompt, "reset-1")
    assert _usage(cluster.url, cluster.model_name, prompt, "reset-2").prompt_tokens_details.cached_tokens == 96
    r = httpx.post(cluster.url + "/reset_prefix_cache", timeout=30)
    assert r.status_code == 200, r.text
    for node in cluster.prefill + cluster.decode:
        assert "prefix cache reset" in node.log_file.read_text()
    assert _usage(cluster.url, cluster.model_name, prompt, "reset-3").prompt_tokens_details.cached_tokens == 0
    # A node that never came up: 503, naming it (the decode node it does know reset all the same).
    r = httpx.post(lone_proxy + "/reset_prefix_cache", timeout=30)
    err = r.json()["error"]
    assert r.status_code == 503 and err["code"] == "reset_failed", r.text
    assert err["message"].startswith("prefix cache not reset on 1 of 2 nodes: prefill ")


def _samples(url: str) -> tuple[set[str], dict[str, float]]:
    families, values = set(), {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        families.add(family.name)
        for s in family.samples:
            values[s.name + "".join(f",{k}={v}" for k, v in sorted(s.labels.items()))] = s.value
    return families, values


def test_metrics_have_pd_serve_request_families_with_the_proxys_counts(cluster):
    node_families, _ = _samples(cluster.decode[0].http_url)
    assert REQUEST_FAMILIES <= node_families
    before = _samples(cluster.url)[1]
    usages = [_usage(cluster.url, cluster.model_name, random_prompt(30 + i, seed=4070 + i), f"metrics-{i}")
              for i in range(3)]
    list(client(cluster.url).completions.create(model=cluster.model_name, prompt="streamed " * 10, max_tokens=3,
                                                temperature=0, extra_body={"ignore_eos": True}, stream=True))
    families, after = _samples(cluster.url)
    assert REQUEST_FAMILIES <= families

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    label = f"model_name={cluster.model_name}"
    assert grew(f"pdserve_requests_total,{label},outcome=length") == 4
    assert grew(f"pdserve_generation_tokens_total,{label}") == sum(u.completion_tokens for u in usages) + 3
    assert grew(f"pdserve_prompt_tokens_total,{label}") >= sum(u.prompt_tokens for u in usages) + 10
    assert grew(f"pdserve_time_to_first_token_seconds_count,{label}") == 4
    # a gap between each two tokens of a request (the streamed one has 3)
    assert grew(f"pdserve_inter_token_latency_seconds_count,{label}") == sum(u.completion_tokens - 1 for u in usages) + 2
    assert grew(f"pdserve_e2e_request_latency_seconds_count,{label}") == 4
    # A request the proxy refuses is counted too, by outcome, as pd-serve counts it.
    r = httpx.post(cluster.url + "/v1/completions", json={"model": cluster.model_name, "prompt": "x", "n": 0},
                   timeout=10)
    assert r.status_code == 400 and _samples(cluster.url)[1][f"pdserve_requests_total,{label},outcome=invalid"] \
        == before.get(f"pdserve_requests_total,{label},outcome=invalid", 0.0) + 1


def test_past_the_itl_slo_with_no_queue_a_request_gets_openais_429_with_retry_after(cluster):
    """Admission control end to end (proxy/admission.py): a second proxy over the same nodes with an ITL SLO no
    token gap can meet (so whether decode is past it depends on traffic, never on this machine's speed) and no
    queue. Requests run until the proxy has sampled a decode node's token gaps; the next is turned away at once:
    429, OpenAI's rate-limit error body, Retry-After from --max-queue-wait, and the OpenAI client's RateLimitError."""
    child, url = extra_proxy(cluster, "proxy-admission", "--slo-itl-ms", "0.0001", "--planner-interval", "0.3",
                             "--planner-window", "60", "--max-queued-requests", "0", "--max-queue-wait", "7")
    body = {"model": cluster.model_name, "prompt": random_prompt(8, seed=429), "max_tokens": 4, "ignore_eos": True}
    try:
        def rejected() -> httpx.Response | None:
            r = httpx.post(url + "/v1/completions", json=body, timeout=120)
            assert r.status_code in (200, 429), r.text
            return r if r.status_code == 429 else None

        r = wait_until(rejected, "the proxy to sample decode past its ITL SLO", 60)
        assert r.headers["Retry-After"] == "7" and r.headers["Content-Type"].startswith("application/json")
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "requests" and error["code"] == "rate_limit_exceeded" and error["param"] is None
        assert "past its latency SLO" in error["message"] and "retry after 7 s" in error["message"]
        with pytest.raises(openai.RateLimitError) as caught:
            client(url).completions.create(model=cluster.model_name, prompt=body["prompt"], max_tokens=4)
        assert caught.value.status_code == 429 and caught.value.response.headers["Retry-After"] == "7"
    finally:
        child.stop()


def test_a_failed_save_is_not_logged_as_committed(cluster):
    """Last: the store's directory becomes a file, so the prefill node's save fails (the request still
    succeeds: the decode node recomputes); the directory comes back afterwards."""
    store = Path(urlsplit(cluster.kv_store).path)
    shutil.rmtree(store)
    store.write_text("not a directory")
    try:
        _usage(cluster.url, cluster.model_name, random_prompt(300, seed=4080), "save-fails")
    finally:
        store.unlink()
        store.mkdir()
    lines = log_lines(cluster.prefill[0].log_file, "save-fails")
    assert any("KV save failed" in line for line in lines), lines
    done = [line for line in lines if "prefill done" in line]
    assert len(done) == 1 and "KV committed" not in done[0] and "KV not saved (" in done[0], lines
