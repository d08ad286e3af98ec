"""The proxy's status page (`/dashboard`, and `/`): every node with its health, load and cache hit rate.

One self-contained HTML page (no external scripts, styles or fonts: it works on an air-gapped
cluster) that polls the proxy's `/status` JSON every second and redraws. Node fields are written
with textContent, never as HTML, so an error message from a node cannot inject markup. The page
counts its successful refreshes in `body[data-updates]` (the browser test watches it).
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
</style>
</head>
<body data-updates="0">
<h1>pdserve proxy</h1>
<div id="meta">policy <span id="policy">-</span> &middot; <span id="state">connecting&hellip;</span></div>
<div class="cards">
  <div class="card">prefill nodes healthy<b id="prefill-healthy">-</b></div>
  <div class="card">decode nodes healthy<b id="decode-healthy">-</b></div>
  <div class="card">requests in flight<b id="in-flight">-</b></div>
  <div class="card">requests routed<b id="routed">-</b></div>
</div>
<h2>Prefill nodes</h2>
<table id="prefill"><thead></thead><tbody></tbody></table>
<h2>Decode nodes</h2>
<table id="decode"><thead></thead><tbody></tbody></table>
<script>
"use strict";
const REFRESH_MS = __REFRESH_MS__;
const COLUMNS = ["node", "health", "in flight", "routed", "running", "waiting", "KV usage", "prefix-cache hit rate"];
const pct = (x) => (x === null || x === undefined) ? "-" : (100 * x).toFixed(1) + "%";

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
  }
  document.getElementById(role + "-healthy").textContent =
    nodes.filter((n) => n.healthy).length + " / " + nodes.length;
}

function draw(status) {
  document.getElementById("policy").textContent = status.policy;
  drawRole("prefill", status.prefill);
  drawRole("decode", status.decode);
  const all = status.prefill.concat(status.decode);
  document.getElementById("in-flight").textContent = String(all.reduce((s, n) => s + n.in_flight, 0));
  document.getElementById("routed").textContent = String(status.decode.reduce((s, n) => s + n.routed, 0));
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
