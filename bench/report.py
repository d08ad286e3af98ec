"""The summary table: one row per figure, one column per run (text for terminals, Markdown for READMEs)."""
from __future__ import annotations

from typing import Any, Callable


def _ms(v: float | None) -> str:
    return "-" if v is None else (f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}")


def _rate(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}" if v < 100 else f"{v:.0f}"


def _tokens(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def _slo_text(slo: dict[str, float | None]) -> str:
    parts = [f"{name} <= {v:g} ms" for name, v in (("TTFT", slo["ttft_ms"]), ("ITL", slo["itl_ms"]),
                                                     ("E2E", slo["e2e_ms"])) if v is not None]
    return ", ".join(parts)


def _goodput(s: dict[str, Any]) -> str:
    g = s["goodput"]
    if g is None:
        return "-"
    return f"{_rate(g['req_per_s'])} ({g['fraction'] * 100:.0f}%)" if g["fraction"] is not None else "-"


def _cache(s: dict[str, Any], compact: bool = False) -> str:
    if s["cached_tokens"] is None:
        return "not reported"
    if compact:
        return "-" if s["cached_fraction"] is None else f"{s['cached_fraction'] * 100:.1f}%"
    pct = f" ({s['cached_fraction'] * 100:.1f}%)" if s["cached_fraction"] is not None else ""
    return f"{s['cached_tokens']:,} of {s['prompt_tokens']:,}{pct}"


def _kv(key: str, fmt: Callable[[Any], str]) -> Callable[[dict[str, Any]], str]:
    return lambda s: "-" if s["kv"] is None or s["kv"].get(key) is None else fmt(s["kv"][key])


def slo_caption(results: list[dict[str, Any]]) -> str:
    slos = {_slo_text(r["summary"]["goodput"]["slo"]) for r in results if r["summary"]["goodput"] is not None}
    return " | ".join(sorted(slos))


def rows(results: list[dict[str, Any]], compact: bool = False) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the comparison table; `compact` (for figures) keeps every cell short and
    leaves the SLOs to `slo_caption`."""
    summaries = [r["summary"] for r in results]
    spec: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("requests ok / sent", lambda s: f"{s['completed']} / {s['requests']}"),
        ("duration (s)", lambda s: f"{s['duration_s']:.1f}"),
    ]
    for key, name in (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        for p in ("p50", "p90", "p99"):
            spec.append((f"{name} {p} (ms)", lambda s, key=key, p=p: _ms(s[key][p])))
    spec += [("requests/s", lambda s: _rate(s["request_throughput"])),
             ("output tokens/s", lambda s: _rate(s["output_throughput"]))]
    if any(s["goodput"] is not None for s in summaries):
        spec.append(("goodput req/s" + ("" if compact else f" ({slo_caption(results)})"), _goodput))
    spec.append(("prompt tokens from cache", lambda s: _cache(s, compact)))
    if any(s["kv"] is not None for s in summaries):
        spec += [("prompt tokens computed (all nodes)", _kv("prompt_tokens_computed", _tokens)),
                 ("KV store hit tokens", _kv("store_hit_tokens", _tokens)),
                 ("KV store loaded tokens", _kv("store_loaded_tokens", _tokens)),
                 ("node prefix-cache hit rate", _kv("prefix_cache_hit_rate", lambda v: f"{v * 100:.1f}%"))]
    header = ["", *[r["label"] for r in results]]
    return header, [[name, *[fmt(s) for s in summaries]] for name, fmt in spec]


def text_table(results: list[dict[str, Any]]) -> str:
    header, body = rows(results)
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    line = lambda row: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                 for i, (c, w) in enumerate(zip(row, widths)))
    return "\n".join([line(header), "  ".join("-" * w for w in widths), *map(line, body)])


def markdown_table(results: list[dict[str, Any]]) -> str:
    header, body = rows(results)
    out = ["| " + " | ".join(header) + " |", "|" + "|".join([":---"] + ["---:"] * (len(header) - 1)) + "|"]
    out += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(out)


def describe(result: dict[str, Any]) -> str:
    """One line naming the workload and the pacing, for table captions."""
    w, load = result["workload"], result["load"]
    params = ", ".join(f"{k}={v}" for k, v in w["params"].items())
    return f"{w['name']} ({params}); {load['pacing']}; {result['endpoint']['api']} API"


def captions(results: list[dict[str, Any]]) -> list[str]:
    """What ran, one line per distinct workload and pacing: the line alone when every run shares it, else
    prefixed with the labels of the runs that did."""
    groups: dict[str, list[str]] = {}
    for r in results:
        groups.setdefault(describe(r), []).append(r["label"])
    if len(groups) == 1:
        return list(groups)
    return [f"{', '.join(labels)}: {line}" for line, labels in groups.items()]
