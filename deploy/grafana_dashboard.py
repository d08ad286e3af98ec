"""The Grafana dashboard of a pdserve cluster, as code: `python -m pdserve.deploy.grafana_dashboard` rewrites
deploy/grafana/pdserve.json (the file to import), and the tests check that the two agree and that
every series a panel queries is exported by a live node or proxy.

Panels read what the nodes (`pd-prefill`, `pd-decode`, `pd-serve`: serving/metrics.py and the
connector counters of connectors/kv_log.py) and the proxy (`pd-proxy`) export on /metrics. The
`instance` variable filters the node panels; Prometheus adds `instance` and `job` when it scrapes
(deploy/grafana/prometheus.yml is a scrape configuration for `make serve`).
"""
from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

DASHBOARD_PATH = Path(__file__).resolve().parent / "grafana" / "pdserve.json"
NODE = '{instance=~"$instance"}'
# The node variable lists the instances that export an engine's gauge, and "All" is those (no catch-all
# regex): pd-proxy exports the same request families (serving/metrics.py RequestMetrics) as the client saw
# them, and the node panels must not mix its figures into the nodes'.
ENGINE_ONLY = "pdserve_num_requests_running"
RATE = "$__rate_interval"
_METRIC = re.compile(r"\bpdserve_[a-z0-9_]+")


@dataclass
class Panel:
    title: str
    targets: list[tuple[str, str]]  # (PromQL, legend)
    unit: str = "short"
    description: str = ""
    stack: bool = False


@dataclass
class Row:
    title: str
    panels: list[Panel] = field(default_factory=list)


def _quantiles(metric: str) -> list[tuple[str, str]]:
    return [(f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{NODE}[{RATE}])))", f"p{round(q * 100)}")
            for q in (0.5, 0.9, 0.99)]


def _per_node_rate(metric: str, legend: str) -> tuple[str, str]:
    return f"sum by (instance) (rate({metric}{NODE}[{RATE}]))", legend


def _ratio(hits: str, total: str, by: str = "instance") -> str:
    return (f"sum by ({by}) (rate({hits}{NODE}[{RATE}])) / "
            f"clamp_min(sum by ({by}) (rate({total}{NODE}[{RATE}])), 1e-9)")


ROWS = [
    Row("Latency (every node that serves tokens: decode nodes and pd-serve)", [
        Panel("Time to first token", _quantiles("pdserve_time_to_first_token_seconds"), "s",
              "Arrival at the node to its first output token."),
        Panel("Inter-token latency", _quantiles("pdserve_inter_token_latency_seconds"), "s"),
        Panel("End-to-end request latency", _quantiles("pdserve_e2e_request_latency_seconds"), "s"),
    ]),
    Row("Load", [
        Panel("Requests running / waiting", [
            (f"pdserve_num_requests_running{NODE}", "running {{instance}}"),
            (f"pdserve_num_requests_waiting{NODE}", "waiting {{instance}}")]),
        Panel("KV cache usage", [(f"pdserve_kv_cache_usage_ratio{NODE}", "{{instance}}")], "percentunit",
              "Fraction of the paged KV blocks in use."),
        Panel("Finished requests by outcome", [
            (f"sum by (outcome) (rate(pdserve_requests_total{NODE}[{RATE}]))", "{{outcome}}")], "reqps",
              stack=True),
        Panel("Tokens", [
            (f"sum(rate(pdserve_prompt_tokens_total{NODE}[{RATE}]))", "prompt tokens/s"),
            (f"sum(rate(pdserve_prompt_tokens_computed_total{NODE}[{RATE}]))", "prompt tokens computed/s"),
            (f"sum(rate(pdserve_generation_tokens_total{NODE}[{RATE}]))", "output tokens/s")], "short",
              "Computed < prompt: the difference came from a prefix cache or the KV store."),
        Panel("Preemptions", [_per_node_rate("pdserve_num_preemptions_total", "{{instance}}")], "ops"),
    ]),
    Row("KV: prefix cache and store", [
        Panel("Prefix-cache hit rate", [
            (_ratio("pdserve_prefix_cache_hits_tokens_total", "pdserve_prefix_cache_queries_tokens_total"),
             "{{instance}}")], "percentunit", "Prompt tokens found in the node's own paged-KV prefix cache."),
        Panel("KV-store hit rate", [
            (_ratio("pdserve_kv_hit_tokens_total", "pdserve_kv_lookup_tokens_total"), "{{instance}}")],
              "percentunit", "Prompt tokens covered by chunks present in the store, at decode-node lookups."),
        Panel("KV loads", [
            _per_node_rate("pdserve_kv_loaded_tokens_total", "loaded tokens/s {{instance}}"),
            _per_node_rate("pdserve_kv_retrieved_tokens_total", "retrieved tokens/s {{instance}}")], "short",
              "Loaded: written into paged KV; retrieved: read from the store (whole chunks)."),
        Panel("KV load time", _quantiles("pdserve_kv_load_seconds"), "s"),
        Panel("KV store traffic", [
            _per_node_rate("pdserve_kv_load_bytes_total", "read {{instance}}"),
            _per_node_rate("pdserve_kv_save_bytes_total", "written {{instance}}")], "Bps"),
        Panel("KV saves", [_per_node_rate("pdserve_kv_saved_tokens_total", "saved tokens/s {{instance}}"),
                           _per_node_rate("pdserve_kv_saved_chunks_total", "chunks/s {{instance}}")], "short"),
        Panel("Fallbacks (KV lookup or load failed: recomputed)", [
            (f"sum by (instance, reason) (rate(pdserve_kv_fallbacks_total{NODE}[{RATE}]))",
             "{{instance}} {{reason}}")], "ops"),
        Panel("Save failures (the request still succeeds)", [
            (f"sum by (instance, reason) (rate(pdserve_kv_save_failures_total{NODE}[{RATE}]))",
             "{{instance}} {{reason}}")], "ops"),
    ]),
    Row("Proxy routing", [
        Panel("Requests routed per node", [
            (f"sum by (role, node) (rate(pdserve_proxy_routed_requests_total[{RATE}]))", "{{role}} {{node}}")],
              "reqps"),
        Panel("In flight per node", [("pdserve_proxy_in_flight_requests", "{{role}} {{node}}")]),
        Panel("Node health", [("pdserve_proxy_node_healthy", "{{role}} {{node}}")], "short",
              "1: in rotation; 0: out (failed health check or request)."),
    ]),
]


def _panel_json(panel: Panel, pid: int, x: int, y: int) -> dict:
    return {
        "id": pid, "type": "timeseries", "title": panel.title, "description": panel.description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"x": x, "y": y, "w": 8, "h": 8},
        "fieldConfig": {"defaults": {"unit": panel.unit, "min": 0,
                                     "custom": {"stacking": {"mode": "normal" if panel.stack else "none"}}},
                        "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        "targets": [{"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend,
                     "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                    for i, (expr, legend) in enumerate(panel.targets)],
    }


def build() -> dict:
    """The dashboard JSON (Grafana 10+ schema)."""
    panels, pid, y = [], 1, 0
    for row in ROWS:
        panels.append({"id": pid, "type": "row", "title": row.title, "collapsed": False,
                       "gridPos": {"x": 0, "y": y, "w": 24, "h": 1}, "panels": []})
        pid, y = pid + 1, y + 1
        for i, panel in enumerate(row.panels):
            panels.append(_panel_json(panel, pid, (i % 3) * 8, y + (i // 3) * 8))
            pid += 1
        y += 8 * ((len(row.panels) + 2) // 3)
    return {
        "title": "pdserve", "uid": "pdserve-cluster", "tags": ["pdserve", "llm"], "editable": True,
        "schemaVersion": 39, "version": 1, "refresh": "10s", "time": {"from": "now-30m", "to": "now"},
        "timezone": "browser", "graphTooltip": 1,
        "description": "pdserve prefill/decode nodes and proxy; written by deploy/grafana_dashboard.py",
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus"},
            {"name": "instance", "label": "node", "type": "query", "multi": True, "includeAll": True,
             "refresh": 2, "current": {"text": "All", "value": "$__all"},
             "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "query": {"query": f"label_values({ENGINE_ONLY}, instance)", "refId": "instance"},
             "definition": f"label_values({ENGINE_ONLY}, instance)"},
        ]},
        "annotations": {"list": []},
        "panels": panels,
    }


def queried_metrics(dashboard: dict) -> set[str]:
    """Every pdserve series name the dashboard's queries and variables read."""
    text = json.dumps([p.get("targets", []) for p in dashboard["panels"]] + dashboard["templating"]["list"])
    return set(_METRIC.findall(text))


def render() -> str:
    return json.dumps(build(), indent=1) + "\n"


def main() -> int:
    DASHBOARD_PATH.parent.mkdir(parents=True, exist_ok=True)
    DASHBOARD_PATH.write_text(render())
    print(f"wrote {DASHBOARD_PATH} ({len(queried_metrics(build()))} series)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
