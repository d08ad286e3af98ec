"""What operators look at: the Grafana dashboard (deploy/grafana/pdserve.json) against a live cluster's
/metrics, and the proxy's status page in a real headless Chromium: its node table, and its KV-store,
latency and throughput panels against the numbers the live nodes export."""
from __future__ import annotations

import asyncio
import io
import json
import subprocess

import httpx
import numpy as np
import pytest
import yaml
from matplotlib import image as mpimg
from prometheus_client.parser import text_string_to_metric_families

from pdserve.deploy.grafana_dashboard import DASHBOARD_PATH, build, queried_metrics
from pdserve.deploy.processes import HOST, Child, free_port, python_module
from pdserve.proxy import node_figures
from tests.helpers.browser import Browser
from tests.helpers.cluster import client, start_cluster, wait_until

pytestmark = pytest.mark.slow

_SUFFIXES = ("_total", "_bucket", "_count", "_sum", "_created")


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory):
    c = start_cluster(tiny_llama, tmp_path_factory.mktemp("dashboards"))
    yield c
    c.stop()


def complete(url: str, prompt: str, max_tokens: int = 3) -> None:
    c = client(url)
    out = c.completions.create(model=c.models.list().data[0].id, prompt=prompt, max_tokens=max_tokens, temperature=0)
    assert out.usage.completion_tokens >= 1


def exported(url: str) -> set[str]:
    """Family and sample names of one /metrics page (a labelled counter with no samples yet still counts)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(s.name for s in family.samples)
    return names


def _family(series: str) -> str:
    for suffix in _SUFFIXES:
        if series.endswith(suffix):
            return series[: -len(suffix)]
    return series


# ------------------------------------------------------------------ Grafana dashboard

def test_dashboard_file_is_the_generated_one():
    assert json.loads(DASHBOARD_PATH.read_text()) == build(), "run: python -m pdserve.deploy.grafana_dashboard"


def test_dashboard_layout():
    d = build()
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in d["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24
        area = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not area & cells, f"panel {p['title']!r} overlaps another"
        cells |= area
        if p["type"] != "row":
            assert p["targets"] and p["datasource"]["uid"] == "${datasource}"
    assert {"datasource", "instance"} <= {v["name"] for v in d["templating"]["list"]}


def test_dashboard_queries_are_valid_promql(tmp_path):
    """promtool parses every panel query (Grafana's variables replaced by what Grafana would put there)."""
    exprs = [t["expr"] for p in build()["panels"] for t in p.get("targets", [])]
    rules = {"groups": [{"name": "pdserve-dashboard", "rules": [
        {"record": f"panel:query{i}", "expr": e.replace("$__rate_interval", "1m").replace("$instance", ".*")}
        for i, e in enumerate(exprs)]}]}
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rules))
    proc = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in proc.stdout


def test_every_dashboard_series_is_exported_by_a_live_node_or_the_proxy(cluster):
    complete(cluster.url, "The dashboard needs some traffic. " * 8)
    live = exported(cluster.url)
    for node in cluster.prefill + cluster.decode:
        live |= exported(f"http://{HOST}:{node.http_port}")
    wanted = queried_metrics(build())
    missing = sorted(s for s in wanted if s not in live and _family(s) not in live)
    assert not missing, f"queried by the dashboard but exported by no node or proxy: {missing}"
    # The routing series carry one label set per node, with the proxy's own counts.
    status = httpx.get(cluster.url + "/status", timeout=5).json()
    text = httpx.get(cluster.url + "/metrics", timeout=5).text
    for n in status["prefill"] + status["decode"]:
        labels = f'node="{n["address"]}",role="{n["role"]}"'
        assert f"pdserve_proxy_routed_requests_total{{{labels}}} {float(n['routed'])}" in text
        assert f"pdserve_proxy_node_healthy{{{labels}}} 1.0" in text


# ------------------------------------------------------------------ status page

def test_status_page_routes(cluster):
    for path in ("/dashboard", "/"):
        r = httpx.get(cluster.url + path, timeout=5)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert "default-src 'none'" in r.headers["content-security-policy"]
        assert "<title>pdserve proxy</title>" in r.text
    # Other unknown paths are still OpenAI-shaped 404s.
    r = httpx.get(cluster.url + "/nope", timeout=5)
    assert r.status_code == 404 and "error" in r.json()


def _rows(role: str) -> str:
    return (f"Array.from(document.querySelectorAll('#{role} tbody tr')).map(r => "
            f"Array.from(r.cells).map(c => c.classList.contains('health') ? c.firstChild.textContent : c.textContent))")


async def _browse(cluster, down_proxy_url: str, down_address: str) -> tuple[list[str], bytes, dict]:
    browser = await Browser(1200, 800).start()
    try:
        await browser.goto(cluster.url + "/dashboard")
        await browser.wait_for("Number(document.body.dataset.updates) >= 1")
        prefill, decode = await browser.eval(_rows("prefill")), await browser.eval(_rows("decode"))
        assert [r[0] for r in prefill] == [n.grpc_address for n in cluster.prefill]
        assert [r[0] for r in decode] == [n.grpc_address for n in cluster.decode]
        assert all(r[1] == "healthy" for r in prefill + decode)
        assert await browser.eval("document.getElementById('decode-healthy').textContent") == "1 / 1"
        # Live: a request through the proxy shows up in the routed counts without a reload.
        before = int(await browser.eval("document.getElementById('routed').textContent"))
        updates = int(await browser.eval("document.body.dataset.updates"))
        await asyncio.to_thread(complete, cluster.url, "count me on the status page")
        await browser.wait_for(f"Number(document.getElementById('routed').textContent) >= {before + 1}")
        assert int(await browser.eval("document.body.dataset.updates")) > updates
        row = (await browser.eval(_rows("decode")))[0]
        assert int(row[3]) >= before + 1 and row[6].endswith("%") and row[7].endswith("%")
        shot = await browser.screenshot()
        viewport = await browser.eval("[window.innerWidth * devicePixelRatio, window.innerHeight * devicePixelRatio]")
        # A proxy whose second decode node is unreachable: that node is shown down, with the reason.
        await browser.goto(down_proxy_url + "/dashboard")
        await browser.wait_for("Number(document.body.dataset.updates) >= 1")
        decode = await browser.eval(_rows("decode"))
        assert [r[:2] for r in decode] == [[cluster.decode[0].grpc_address, "healthy"], [down_address, "down"]]
        assert await browser.eval("document.getElementById('decode-healthy').textContent") == "1 / 2"
        assert await browser.eval("document.querySelector('#decode .err').textContent")
        return browser.errors, shot, {"viewport": viewport}
    finally:
        await browser.close()


@pytest.mark.browser
def test_status_page_in_chromium(cluster):
    down_address = f"{HOST}:{free_port()}"  # nothing listens there
    port = free_port()
    proxy = Child("proxy-down", python_module(
        "pdserve.proxy", "--port", str(port), "--health-interval", "0.3", "--prefill", cluster.prefill[0].grpc_address,
        "--decode", f"{cluster.decode[0].grpc_address},{down_address}"), cluster.spec.log_dir)
    proxy.start()
    url = f"http://{HOST}:{port}"
    try:
        wait_until(lambda: _decode_health(url) == [True, False], "the second proxy's health checks", 60)
        errors, shot, info = asyncio.run(_browse(cluster, url, down_address))
    finally:
        proxy.stop()
    assert errors == [], errors
    # The screenshot: the whole viewport, rendered (not a blank page).
    pixels = mpimg.imread(io.BytesIO(shot), format="png")
    assert [pixels.shape[1], pixels.shape[0]] == info["viewport"]
    colours = np.unique((pixels[..., :3] * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colours) > 20, "the page looks blank"
    top = pixels[: pixels.shape[0] // 3]
    assert (top[..., :3].std(axis=(0, 1)) > 0.02).all(), "no text or tables in the upper part of the page"


def _decode_health(url: str) -> list[bool] | None:
    try:
        return [n["healthy"] for n in httpx.get(url + "/status", timeout=2).json()["decode"]]
    except (httpx.HTTPError, ValueError):
        return None


# ------------------------------------------------------------------ status page: the nodes' own figures

def _oracle_quantile(q: float, text: str, name: str) -> float | None:
    """histogram_quantile(q, name) over one node's whole histogram, written out here as the test's oracle."""
    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name + "_bucket":
                buckets[float(s.labels["le"])] = buckets.get(float(s.labels["le"]), 0.0) + s.value
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    if total == 0:
        return None
    rank, prev_bound, prev_count = q * total, 0.0, 0.0
    for b in bounds:
        if buckets[b] >= rank:
            if b == float("inf"):
                return prev_bound
            return prev_bound + (b - prev_bound) * (rank - prev_count) / (buckets[b] - prev_count)
        prev_bound, prev_count = b, buckets[b]
    return prev_bound


def _node_numbers(http_url: str) -> dict[str, object]:
    """What the page must show for one node, from the node's own /metrics."""
    text = httpx.get(http_url + "/metrics", timeout=10).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            values[s.name] = values.get(s.name, 0.0) + s.value
    lookups = values["pdserve_kv_lookup_tokens_total"]

    def pair(name: str) -> str:
        p50, p99 = (_oracle_quantile(q, text, name) for q in (0.5, 0.99))
        if p50 is None:
            return "-"
        return " / ".join(f"{v * 1e3:.0f}" if v * 1e3 >= 100 else f"{v * 1e3:.1f}" for v in (p50, p99))

    return {"store hit rate": f"{100 * values['pdserve_kv_hit_tokens_total'] / lookups:.1f}%" if lookups else "-",
            "loads": str(int(values["pdserve_kv_load_seconds_count"])),
            "fallbacks": str(int(values.get("pdserve_kv_fallbacks_total", 0))),
            "save failures": str(int(values.get("pdserve_kv_save_failures_total", 0))),
            "ttft": pair("pdserve_time_to_first_token_seconds"), "itl": pair("pdserve_inter_token_latency_seconds")}


def _same_figure(shown: str, want: str) -> bool:
    """Equal, or for latency pairs equal to one unit of the last printed digit: the page interpolates the
    quantile in JavaScript, the oracle in Python, and a value on a rounding boundary may print either way."""
    if shown == want or " / " not in want:
        return shown == want
    pairs = list(zip(shown.split(" / "), want.split(" / ")))
    return len(pairs) == 2 and all(abs(float(a) - float(b)) <= (1.0 if "." not in b else 0.1) + 1e-9 for a, b in pairs)


_NEW_COLUMNS = ("store hit rate", "loads", "fallbacks", "save failures", "ttft", "itl")  # cells 8..13


@pytest.fixture(scope="module")
def redis_cluster(tiny_llama, tmp_path_factory):
    c = start_cluster(tiny_llama, tmp_path_factory.mktemp("dashboards-redis"), store="redis")
    yield c
    c.stop()


def _sampled(url: str, predicate) -> bool:
    status = httpx.get(url + "/status", timeout=5).json()
    return all(n["metrics"] is not None for n in status["prefill"] + status["decode"]) and predicate(status)


async def _panels(url: str) -> tuple[list[str], dict[str, list[list[str]]], dict[str, str], list[str]]:
    browser = await Browser(1400, 900).start()
    try:
        await browser.goto(url + "/dashboard")
        await browser.wait_for("Number(document.body.dataset.updates) >= 1")
        rows = {role: await browser.eval(_rows(role)) for role in ("prefill", "decode")}
        header = await browser.eval("Array.from(document.querySelectorAll('#decode thead th')).map(h => h.textContent)")
        cards = await browser.eval("Object.fromEntries(Array.from(document.querySelectorAll('.card')).map(c => "
                                   "[c.firstChild.textContent.trim(), c.innerText]))")
        cards["throughput points"] = await browser.eval("document.getElementById('throughput-spark').dataset.points")
        cards["hit-rate points"] = await browser.eval("document.getElementById('hit-rate-spark').dataset.points")
        cards["throughput"] = await browser.eval("document.getElementById('throughput').textContent")
        cards["hit rate"] = await browser.eval("document.getElementById('store-hit-rate').textContent")
        return header, rows, cards, browser.errors
    finally:
        await browser.close()


@pytest.mark.browser
def test_status_page_panels_show_the_live_nodes_numbers(redis_cluster):
    """Real traffic through a redis-store cluster: two requests whose KV goes through the store, then
    redis-server dies and a third request's save fails on the prefill node and its lookup falls back on the
    decode node. The page's KV-store, TTFT and ITL cells equal what each node's own /metrics says; the
    cards show the decode nodes' throughput and store hit rate with a ten-minute sparkline, and say whose
    numbers they are."""
    c = redis_cluster
    for i in range(2):
        complete(c.url, f"Request {i} of the dashboard test reads and writes the KV store. " * 12, max_tokens=8)
    c.store_server.kill()
    complete(c.url, "After the store died this request recomputes its prompt. " * 12, max_tokens=8)
    decode_fallbacks = lambda st: st["decode"][0]["metrics"]["store"]["fallbacks"] >= 1  # noqa: E731
    prefill_failures = lambda st: st["prefill"][0]["metrics"]["store"]["save_failures"] >= 1  # noqa: E731
    wait_until(lambda: _sampled(c.url, lambda st: decode_fallbacks(st) and prefill_failures(st)),
               "the proxy's sample of the failures", 3 * node_figures.SAMPLE_S + 10)
    # The page shows the proxy's last sample of each node's /metrics: a sample taken while the last request's
    # final token gaps were still being counted lags the node by them until the next sample, so compare until a
    # sample and the node agree (bounded), then report the last difference seen.
    differences: list = []

    def page_equals_nodes() -> tuple | None:
        header, rows, cards, errors = asyncio.run(_panels(c.url))
        differences[:] = [(role, column, row, want)
                          for role, nodes in (("prefill", c.prefill), ("decode", c.decode))
                          for row, node in zip(rows[role], nodes, strict=True)
                          for want, shown in [(_node_numbers(node.http_url), dict(zip(_NEW_COLUMNS, row[8:])))]
                          for column in _NEW_COLUMNS if not _same_figure(shown[column], want[column])]
        return None if differences else (header, rows, cards, errors)

    try:
        header, rows, cards, errors = wait_until(page_equals_nodes, "the page's cells to equal the nodes' /metrics",
                                                 3 * node_figures.SAMPLE_S + 10)
    except AssertionError as e:
        raise AssertionError(f"{e}: last differences {differences}") from None
    assert errors == [], errors
    assert header[8:] == ["KV-store hit rate", "store loads", "fallbacks", "save failures", "TTFT p50 / p99 (ms)",
                          "ITL p50 / p99 (ms)", "found by"]
    assert {row[14] for role in rows for row in rows[role]} == {"static"}  # the cluster's --prefill/--decode lists
    decode, prefill = rows["decode"][0], rows["prefill"][0]
    assert int(decode[9]) >= 2 and int(decode[10]) >= 1 and int(prefill[11]) >= 1  # loads, fallback, save failure
    assert decode[12] != "-" and decode[13] != "-"  # the decode node measured TTFT and ITL
    # The cluster cards: the decode nodes' last minute, and a line over ten minutes.
    assert float(cards["throughput"]) > 0 and cards["hit rate"].endswith("%")
    assert int(cards["throughput points"]) >= 1 and int(cards["hit-rate points"]) >= 1
    assert "by this proxy to decode nodes" in cards["requests routed"]
    assert "decode nodes" in cards["output tokens/s"] and "decode nodes" in cards["KV-store hit rate"]


def test_figures_from_a_real_histogram():
    """NodeFigures on prometheus_client's own exposition: windows, restarts and the quantile rule."""
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    def node() -> tuple:
        r = CollectorRegistry()
        ttft = Histogram("pdserve_time_to_first_token_seconds", "", ["model_name"], buckets=(0.01, 0.1, 1.0),
                         registry=r).labels("m")
        hits = Counter("pdserve_kv_hit_tokens", "", registry=r)
        lookups = Counter("pdserve_kv_lookup_tokens", "", registry=r)
        return r, ttft, hits, lookups

    r, ttft, hits, lookups = node()
    figures = node_figures.NodeFigures()
    created = node_figures.parse(generate_latest(r).decode(), 0.0).created
    t0 = created + 1.0
    figures.add(node_figures.parse(generate_latest(r).decode(), t0))
    assert figures.samples[0].t == created  # a node started within the history counts from its start
    for v in (0.005, 0.05, 0.05, 0.5):
        ttft.observe(v)
    hits.inc(300)
    lookups.inc(400)
    figures.add(node_figures.parse(generate_latest(r).decode(), t0 + 5))
    st = figures.status()
    assert st["store"]["hit_rate"] == 0.75 and st["store"]["lookup_tokens"] == 400
    # rank 2 of 4 lies in (0.01, 0.1] holding 2: 0.01 + 0.09 * (2 - 1) / 2
    assert st["latency"]["ttft_ms"]["p50"] == pytest.approx(55.0)
    assert st["history"]["output_tokens"][-1] == 4 and st["history"]["store_hit_tokens"][-1] == 300
    # A minute later only the newer observations count.
    figures.add(node_figures.parse(generate_latest(r).decode(), t0 + 65))
    ttft.observe(2.0)  # beyond the last finite bound: reported as that bound
    figures.add(node_figures.parse(generate_latest(r).decode(), t0 + 70))
    st = figures.status()
    assert st["latency"]["ttft_ms"] == {"p50": 1000.0, "p99": 1000.0}
    # The node restarts: its counters start again from 0 and count as the increase.
    r, ttft, hits, lookups = node()
    lookups.inc(10)
    figures.add(node_figures.parse(generate_latest(r).decode(), t0 + 75))
    assert figures.status()["history"]["store_lookup_tokens"][-1] == 10
    assert figures.status()["store"]["lookup_tokens"] == 10
