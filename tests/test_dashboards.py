"""What operators look at: the Grafana dashboard (deploy/grafana/pdserve.json) against a live cluster's
/metrics, and the proxy's status page in a real headless Chromium."""
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
from tests.browser import Browser
from tests.cluster_helpers import client, start_cluster, wait_until

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
