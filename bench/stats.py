"""The numbers of a run: percentiles, throughput, goodput at SLOs, cache hits, and their time series.

Definitions (also in the JSON schema's descriptions):
- duration: first request sent to last response finished;
- req/s: completed requests / duration; output tok/s: output tokens of completed requests / duration;
- ITL percentiles are over every inter-token gap of every completed request;
- goodput: completed requests that meet every SLO given, per second of duration. A request
  meets the TTFT SLO when its TTFT <= it, the ITL SLO when its mean inter-token gap (vLLM's
  TPOT) <= it, the E2E SLO when its E2E <= it. A request with one output token has no gaps
  and meets any ITL SLO.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

PERCENTILES = (50, 90, 99)
_SLACK_S = 1e-9
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s|us)?\s*$")


def parse_duration(text: str) -> float:
    """'500ms', '0.5s', '250us' or a bare number of milliseconds -> seconds."""
    m = _DURATION.match(str(text))
    if not m:
        raise ValueError(f"not a duration: {text!r} (examples: 500ms, 0.5s)")
    value, unit = float(m.group(1)), m.group(2) or "ms"
    return value * {"s": 1.0, "ms": 1e-3, "us": 1e-6}[unit]


@dataclass
class SLO:
    ttft_s: float | None = None
    itl_s: float | None = None
    e2e_s: float | None = None

    @property
    def given(self) -> bool:
        return any(v is not None for v in (self.ttft_s, self.itl_s, self.e2e_s))

    def to_json(self) -> dict[str, float | None]:
        return {k: None if v is None else round(v * 1e3, 6) for k, v in
                (("ttft_ms", self.ttft_s), ("itl_ms", self.itl_s), ("e2e_ms", self.e2e_s))}

    def met(self, r: dict[str, Any]) -> bool:
        """Whether a request meets every SLO given (a nanosecond of slack absorbs float rounding)."""
        if not r["ok"]:
            return False
        if self.ttft_s is not None and r["ttft"] > self.ttft_s + _SLACK_S:
            return False
        if self.itl_s is not None and r["itl"] and sum(r["itl"]) / len(r["itl"]) > self.itl_s + _SLACK_S:
            return False
        return self.e2e_s is None or r["e2e"] <= self.e2e_s + _SLACK_S


def percentile(values: Iterable[float], p: float) -> float:
    """The p-th percentile (0..100) of values, interpolated linearly between the two nearest (numpy's
    default; p 50 is the median): the one rule of pd-bench's reports and of benchmarks/."""
    arr = np.asarray(list(values), dtype=float)
    if arr.size == 0:
        raise ValueError("no values to take a percentile of")
    return float(np.percentile(arr, p))


def distribution_ms(values: Iterable[float]) -> dict[str, float | None]:
    """mean and p50/p90/p99 in milliseconds (None when there are no values)."""
    arr = np.asarray(list(values), dtype=float) * 1e3
    if arr.size == 0:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    return {"mean": round(float(arr.mean()), 3), **{f"p{p}": round(percentile(arr, p), 3) for p in PERCENTILES}}


def run_window(requests: list[dict[str, Any]]) -> tuple[float, float]:
    """(first start, last finish) in seconds since the run started."""
    done = [r for r in requests if r["ok"]]
    if not done:
        return 0.0, 0.0
    return min(r["start"] for r in requests), max(r["start"] + r["e2e"] for r in done)


def summarize(requests: list[dict[str, Any]], slo: SLO, kv_delta: dict[str, float] | None = None) -> dict[str, Any]:
    from pdserve.bench.scrape import (KV_HIT_TOKENS, KV_LOADED_TOKENS, KV_LOOKUPS, PREFIX_HITS, PREFIX_QUERIES,
                               PROMPT_COMPUTED)

    done = [r for r in requests if r["ok"]]
    first, last = run_window(requests)
    duration = last - first
    per_s = (lambda n: round(n / duration, 4)) if duration > 0 else (lambda n: None)
    prompt = sum(r["prompt_tokens"] or 0 for r in done)
    reported = [r["cached_tokens"] for r in done if r["cached_tokens"] is not None]
    cached = sum(reported) if reported else None
    output = sum(r["output_tokens"] for r in done)
    out: dict[str, Any] = {
        "requests": len(requests), "completed": len(done), "failed": len(requests) - len(done),
        "duration_s": round(duration, 4), "request_throughput": per_s(len(done)), "output_throughput": per_s(output),
        "ttft_ms": distribution_ms(r["ttft"] for r in done),
        "itl_ms": distribution_ms(g for r in done for g in r["itl"]),
        "e2e_ms": distribution_ms(r["e2e"] for r in done),
        "prompt_tokens": prompt, "output_tokens": output, "cached_tokens": cached,
        "cached_fraction": round(cached / prompt, 4) if cached is not None and prompt else None,
        "goodput": None, "kv": None,
    }
    if slo.given:
        good = sum(slo.met(r) for r in requests)
        out["goodput"] = {"slo": slo.to_json(), "good_requests": good, "req_per_s": per_s(good),
                          "fraction": round(good / len(requests), 4) if requests else None}
    if kv_delta:
        get = lambda name: kv_delta.get(name)  # noqa: E731
        hits, queries = get(PREFIX_HITS), get(PREFIX_QUERIES)
        out["kv"] = {"store_lookups": get(KV_LOOKUPS), "store_hit_tokens": get(KV_HIT_TOKENS),
                     "store_loaded_tokens": get(KV_LOADED_TOKENS), "prompt_tokens_computed": get(PROMPT_COMPUTED),
                     "prefix_cache_hit_tokens": hits,
                     "prefix_cache_hit_rate": round(hits / queries, 4) if hits is not None and queries else None}
    return out


def token_times(r: dict[str, Any]) -> list[float]:
    """Arrival time of each output token of a completed request (seconds since the run started)."""
    times = [r["start"] + r["ttft"]]
    for gap in r["itl"]:
        times.append(times[-1] + gap)
    return times


def _bins(duration: float, bin_s: float | None) -> np.ndarray:
    width = bin_s or max(0.25, duration / 40)
    return np.arange(0.0, duration + width, width)


def throughput_series(requests: list[dict[str, Any]], bin_s: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(bin centres s, output tokens/s in each bin)."""
    done = [r for r in requests if r["ok"]]
    times = np.array([t for r in done for t in token_times(r)])
    edges = _bins(float(times.max()) if times.size else 0.0, bin_s)
    counts, _ = np.histogram(times, bins=edges)
    width = edges[1] - edges[0]
    return (edges[:-1] + edges[1:]) / 2, counts / width


# Where prompt tokens came from. From pdserve's counters, summed over the nodes scraped, the three are disjoint
# per node: its local prefix-cache hits, what it loaded from the KV store, what it ran through the model. On P/D
# each prompt is served twice (by its prefill node, then by its decode node), so the three add up to about twice
# the prompt tokens. Usage's `cached_tokens` counts only KV from earlier requests (a P/D proxy reports its
# prefill node's hits, not the hand-off to decode), as pd-serve's does (docs/vllm-compat.md).
LOCAL, STORE, COMPUTED = "local prefix cache", "KV store", "computed"
# Without counters (another server), the client's view: usage's cached_tokens and the rest.
CACHED_USAGE, COMPUTED_USAGE = "cached (usage)", "computed (prompt - cached)"


def _tier_metrics() -> dict[str, str]:
    from pdserve.bench.scrape import KV_LOADED_TOKENS, PREFIX_HITS, PROMPT_COMPUTED

    return {LOCAL: PREFIX_HITS, STORE: KV_LOADED_TOKENS, COMPUTED: PROMPT_COMPUTED}


def prompt_sources(result: dict[str, Any]) -> dict[str, float] | None:
    """{tier: prompt tokens} over the run: the nodes' counters when scraped, else usage; None without either."""
    metrics = result.get("metrics")
    if metrics and metrics.get("delta"):
        got = {tier: metrics["delta"].get(name) for tier, name in _tier_metrics().items()}
        if any(v is not None for v in got.values()):
            return {tier: v or 0.0 for tier, v in got.items()}
    s = result["summary"]
    if s["cached_tokens"] is None:
        return None
    return {CACHED_USAGE: float(s["cached_tokens"]), COMPUTED_USAGE: float(s["prompt_tokens"] - s["cached_tokens"])}


def prompt_source_series(result: dict[str, Any], bin_s: float | None = None
                         ) -> tuple[np.ndarray, dict[str, np.ndarray]] | None:
    """(interval edges s, {tier: prompt tokens/s in each interval}): between the counter samples of the run
    (before, every --metrics-interval, after), else the requests' usage binned by finish time; None without
    either."""
    metrics = result.get("metrics")
    if metrics and metrics.get("delta"):
        names = _tier_metrics()
        points = [{"t": 0.0, **metrics["before"]}, *metrics["timeline"]]
        end = run_window(result["requests"])[1]  # `after` was read once the last response had finished
        if end > points[-1]["t"]:
            points.append({"t": end, **metrics["after"]})
        if any(name in p for p in points for name in names.values()):
            edges = np.array([p["t"] for p in points])
            width = np.maximum(np.diff(edges), 1e-9)
            series = {}
            for tier, name in names.items():
                values = np.array([p.get(name, np.nan) for p in points], dtype=float)
                series[tier] = np.nan_to_num(np.maximum(np.diff(values), 0.0) / width)
            return edges, series
    done = [r for r in result["requests"] if r["ok"] and r["cached_tokens"] is not None and r["prompt_tokens"]]
    if not done:
        return None
    finish = np.array([r["start"] + r["e2e"] for r in done])
    edges = _bins(float(finish.max()), bin_s)
    width = edges[1] - edges[0]
    cached, _ = np.histogram(finish, bins=edges, weights=[r["cached_tokens"] for r in done])
    prompt, _ = np.histogram(finish, bins=edges, weights=[r["prompt_tokens"] for r in done])
    return edges, {CACHED_USAGE: cached / width, COMPUTED_USAGE: (prompt - cached) / width}
