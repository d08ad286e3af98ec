"""The proxy's status page (`/dashboard`, and `/`): every node with its health, load, cache and KV-store
figures and latencies, and the cluster's throughput and store hit rate over ten minutes.

One self-contained HTML page (no external scripts, styles or fonts: it works on an air-gapped
cluster) that polls the proxy's `/status` JSON every second and redraws. Node fields are written
with textContent, never as HTML, so an error message from a node cannot inject markup. The page
counts its successful refreshes in `body[data-updates]` (the browser test watches it).

Whose numbers: health, in flight and routed are this proxy's own; the KV-store columns, TTFT and
ITL come from each node's /metrics, sampled by the proxy (proxy/node_figures.py says how); the
cluster cards add up the decode nodes' samples of each tick (the sparklines: one point per tick,
ten minutes).
"""
from __future__ import annotations

from aiohttp import web

REFRESH_MS = 1000

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>pdserve proxy</title>
<style>
  body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #1d2330; background: #f6f7f9; }
  h1 { font-size: 1.3em; margin: 0 0 .2em; }
  h2 { font-size: 1.05em; margin: 1.4em 0 .4em; }
  #meta { color: #5b6475; }
  #state.down { color: #b3261e; font-weight: 600; }
  .cards { display: flex; gap: .8em; flex-wrap: wrap; margin-top: 1em; }
  .card { background: #fff; border: 1px solid #dde1e8; border-radius: 6px; padding: .6em 1em; min-width: 9em; }
  .card b { display: block; font-size: 1.5em; }
  table { border-collapse: collapse; background: #fff; width: 100%; }
  th, td { border: 1px solid #dde1e8; padding: .35em .6em; text-align: right; }
  th:nth-child(-n+2), td:nth-child(-n+2) { text-align: left; }
  th { background: #eef1f5; font-weight: 600; }
  .ok::before { content: "\\25CF "; color: #1e8e3e; }
  .bad::before { content: "\\25CF "; color: #b3261e; }
  .err { color: #b3261e; font-size: .85em; }
  .bar { display: inline-block; width: 5em; height: .7em; background: #e4e7ec; margin-right: .4em; }
  .bar > span { display: block; height: 100%; background: #3b6fd6; }
  .card small { display: block; color: #5b6475; font-size: .8em; max-width: 16em; }
  .spark { display: block; margin-top: .3em; }
  .spark polyline { fill: none; stroke: #3b6fd6; stroke-width: 1.5; }
  .spark rect { fill: #eef1f5; }
  .note { color: #5b6475; font-size: .85em; margin: .4em 0 0; }
</style>
</head>
<body data-updates="0">
<h1>pdserve proxy</h1>
<div id="meta">policy <span id="policy">-</span> &middot; <span id="state">connecting&hellip;</span></div>
<div class="cards">
  <div class="card">prefill nodes healthy<b id="prefill-healthy">-</b><small>by this proxy's health checks</small></div>
  <div class="card">decode nodes healthy<b id="decode-healthy">-</b><small>by this proxy's health checks</small></div>
  <div class="card">requests in flight<b id="in-flight">-</b><small>this proxy's open calls, all nodes</small></div>
  <div class="card">requests routed<b id="routed">-</b><small>by this proxy to decode nodes since it started,
    retries included</small></div>
  <div class="card">output tokens/s<b id="throughput">-</b><small>decode nodes, last minute; line: last 10 minutes
    </small><svg id="throughput-spark" class="spark" width="180" height="36"></svg></div>
  <div class="card">KV-store hit rate<b id="store-hit-rate">-</b><small>decode nodes' store lookups (hit tokens /
    prompt tokens), last minute; line: last 10 minutes</small>
    <svg id="hit-rate-spark" class="spark" width="180" height="36"></svg></div>
</div>
<h2>Prefill nodes</h2>
<table id="prefill"><thead></thead><tbody></tbody></table>
<h2>Decode nodes</h2>
<table id="decode"><thead></thead><tbody></tbody></table>
<p class="note">In flight and routed: this proxy's counts. KV usage and prefix-cache hit rate: the node's last
health probe. KV-store columns: the node's own counters since it started (its /metrics, read by this proxy every
few seconds). TTFT and ITL: measured by the node over the last minute, from a request's arrival at that node (a
decode node's TTFT leaves out the prefill). Found by: how this proxy learned of the node (static flags, the
fleet registry, DNS; <code>/fleet</code> lists each with what it announced).</p>
<script>
"use strict";
const REFRESH_MS = __REFRESH_MS__;
const COLUMNS = ["node", "health", "in flight", "routed", "running", "waiting", "KV usage", "prefix-cache hit rate",
                 "KV-store hit rate", "store loads", "fallbacks", "save failures", "TTFT p50 / p99 (ms)",
                 "ITL p50 / p99 (ms)", "found by"];
const WINDOW_S = 60, HISTORY_S = 600;
const missing = (x) => x === null || x === undefined;
const pct = (x) => missing(x) ? "-" : (100 * x).toFixed(1) + "%";
const ms = (x) => missing(x) ? "-" : (x >= 100 ? x.toFixed(0) : x.toFixed(1));
const pair = (d) => (!d || (missing(d.p50) && missing(d.p99))) ? "-" : ms(d.p50) + " / " + ms(d.p99);
const count = (store, key) => store ? String(store[key]) : "-";

function cell(row, text, cls) {
  const td = row.insertCell();
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}

function drawRole(role, nodes) {
  const table = document.getElementById(role);
  if (!table.tHead.rows.length) {
    const head = table.tHead.insertRow();
    for (const name of COLUMNS) {
      const th = document.createElement("th");
      th.textContent = name;
      head.appendChild(th);
    }
  }
  const body = table.tBodies[0];
  body.replaceChildren();
  for (const n of nodes) {
    const row = body.insertRow();
    row.dataset.role = role;
    row.dataset.address = n.address;
    cell(row, n.address);
    const health = cell(row, n.healthy ? "healthy" : "down", "health " + (n.healthy ? "ok" : "bad"));
    if (!n.healthy && n.last_error) {
      const err = document.createElement("div");
      err.className = "err";
      err.textContent = n.last_error;
      health.appendChild(err);
    }
    cell(row, String(n.in_flight));
    cell(row, String(n.routed));
    cell(row, String(n.running));
    cell(row, String(n.waiting));
    const kv = cell(row, "");
    const bar = document.createElement("span");
    bar.className = "bar";
    const fill = document.createElement("span");
    fill.style.width = Math.min(100, 100 * (n.kv_usage || 0)).toFixed(1) + "%";
    bar.appendChild(fill);
    kv.append(bar, pct(n.kv_usage));
    cell(row, pct(n.prefix_cache_hit_rate));
    const m = n.metrics, store = m ? m.store : null;
    cell(row, store ? pct(store.hit_rate) : "-");
    for (const key of ["loads", "fallbacks", "save_failures"]) cell(row, count(store, key));
    cell(row, m ? pair(m.latency.ttft_ms) : "-");
    cell(row, m ? pair(m.latency.itl_ms) : "-");
    cell(row, n.source || "-");  // static, redis or dns: GET /fleet has the rest of what the node announced
  }
  document.getElementById(role + "-healthy").textContent =
    nodes.filter((n) => n.healthy).length + " / " + nodes.length;
}

// The decode nodes' history summed per tick (the proxy samples every node at one time per tick).
function clusterTicks(nodes) {
  const ticks = new Map();
  for (const n of nodes) {
    const h = n.metrics && n.metrics.history;
    if (!h) continue;
    h.t.forEach((t, i) => {
      const e = ticks.get(t) || {t: t, seconds: 0, tokens: 0, hits: 0, lookups: 0};
      e.seconds = Math.max(e.seconds, h.seconds[i]);
      e.tokens += h.output_tokens[i];
      e.hits += h.store_hit_tokens[i];
      e.lookups += h.store_lookup_tokens[i];
      ticks.set(t, e);
    });
  }
  return Array.from(ticks.values()).sort((a, b) => a.t - b.t);
}

function spark(id, points, top, now) {
  const svg = document.getElementById(id);
  const w = Number(svg.getAttribute("width")), h = Number(svg.getAttribute("height"));
  const NS = "http://www.w3.org/2000/svg";
  svg.replaceChildren();
  const bg = document.createElementNS(NS, "rect");
  bg.setAttribute("width", w);
  bg.setAttribute("height", h);
  svg.appendChild(bg);
  let run = [];
  const flush = () => {
    if (run.length) {
      const line = document.createElementNS(NS, "polyline");
      line.setAttribute("points", (run.length === 1 ? [run[0], run[0]] : run).join(" "));
      svg.appendChild(line);
    }
    run = [];
  };
  for (const [t, v] of points) {
    if (missing(v)) { flush(); continue; }
    const x = Math.max(0, w - (now - t) / HISTORY_S * w), y = h - 2 - (h - 4) * Math.min(1, v / (top || 1));
    run.push(x.toFixed(1) + "," + y.toFixed(1));
  }
  flush();
  svg.dataset.points = String(points.filter(([, v]) => !missing(v)).length);
}

function drawCluster(decode) {
  const ticks = clusterTicks(decode);
  const now = ticks.length ? ticks[ticks.length - 1].t : 0;
  const recent = ticks.filter((e) => now - e.t < WINDOW_S);
  const sum = (key) => recent.reduce((s, e) => s + e[key], 0);
  const seconds = sum("seconds"), lookups = sum("lookups");
  document.getElementById("throughput").textContent = seconds ? (sum("tokens") / seconds).toFixed(1) : "-";
  document.getElementById("store-hit-rate").textContent = lookups ? pct(sum("hits") / lookups) : "-";
  const rates = ticks.map((e) => [e.t, e.seconds ? e.tokens / e.seconds : null]);
  spark("throughput-spark", rates, Math.max(1, ...rates.map(([, v]) => v || 0)), now);
  spark("hit-rate-spark", ticks.map((e) => [e.t, e.lookups ? e.hits / e.lookups : null]), 1, now);
}

function draw(status) {
  document.getElementById("policy").textContent = status.policy;
  drawRole("prefill", status.prefill);
  drawRole("decode", status.decode);
  const all = status.prefill.concat(status.decode);
  document.getElementById("in-flight").textContent = String(all.reduce((s, n) => s + n.in_flight, 0));
  document.getElementById("routed").textContent = String(status.decode.reduce((s, n) => s + n.routed, 0));
  drawCluster(status.decode);
}

function setState(text, down) {
  const el = document.getElementById("state");
  el.textContent = text;
  el.className = down ? "down" : "";
}

async function refresh() {
  try {
    const r = await fetch("status", {cache: "no-store"});
    if (!r.ok) throw new Error("HTTP " + r.status);
    draw(await r.json());
    document.body.dataset.updates = String(Number(document.body.dataset.updates) + 1);
    setState("updated " + new Date().toLocaleTimeString(), false);
  } catch (e) {
    setState("cannot reach the proxy (" + e.message + ")", true);
  } finally {
    setTimeout(refresh, REFRESH_MS);
  }
}
refresh();
</script>
</body>
</html>
""".replace("__REFRESH_MS__", str(REFRESH_MS))

# The page's own inline script and style only; nothing else may load or run.
_HEADERS = {"Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; "
                                       "style-src 'unsafe-inline'; connect-src 'self'",
            "Cache-Control": "no-store"}


async def page(request: web.Request) -> web.Response:
    return web.Response(text=PAGE, content_type="text/html", headers=_HEADERS)


def add_routes(app: web.Application) -> None:
    """`/dashboard`, and `/` when nothing else serves it."""
    app.router.add_get("/dashboard", page)
    if not any(r.resource is not None and r.resource.canonical == "/" for r in app.router.routes()):
        app.router.add_get("/", page)
