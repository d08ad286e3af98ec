"""What the proxy's status page shows of each node beyond its health: the node's own /metrics, sampled.

Every SAMPLE_S the health monitor (proxy/health.py) reads each healthy node's `/metrics` on its HTTP
port and hands the text to that node's `NodeFigures`, which keeps ten minutes of samples. From them:

- the KV-store figures, the node's own counters since it started: store hit rate (hit tokens over
  prompt tokens looked up), loads, fallbacks (a lookup or load failed: recomputed), save failures;
- TTFT and ITL p50/p99 over the last minute (or over the samples there are, when fewer), from the
  node's histograms the way Prometheus' histogram_quantile reads them (linear within a bucket). They are
  the node's view: from a request's arrival at the node, so a decode node's TTFT excludes the prefill;
- a ten-minute history, one entry per sample: output tokens streamed (`TTFT count + ITL count`: every
  streamed token is observed in exactly one of the two, serving/metrics.py) and store hit / lookup
  tokens since the previous sample. The page adds the nodes' entries of one tick up for the cluster's
  sparklines.

A node started within the history counts from its start (all its counters were 0 then; the histogram's
`_created` time says when), so what it did before the proxy's first sample of it is not lost.

A counter that went down means the node restarted: its new value is the increase (as Prometheus' rate()).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

SAMPLE_S = 5.0
HISTORY_S = 600.0
WINDOW_S = 60.0

TTFT = "pdserve_time_to_first_token_seconds"
ITL = "pdserve_inter_token_latency_seconds"
# sample name -> the figure it feeds (summed over label sets: a reason, a model name)
COUNTERS = {
    "pdserve_kv_lookups_total": "lookups",
    "pdserve_kv_lookup_tokens_total": "lookup_tokens",
    "pdserve_kv_hit_tokens_total": "hit_tokens",
    "pdserve_kv_loaded_tokens_total": "loaded_tokens",
    "pdserve_kv_load_seconds_count": "loads",
    "pdserve_kv_fallbacks_total": "fallbacks",
    "pdserve_kv_saved_chunks_total": "saved_chunks",
    "pdserve_kv_save_failures_total": "save_failures",
    f"{TTFT}_count": "first_tokens",
    f"{ITL}_count": "later_tokens",
}


@dataclass
class Sample:
    """One scrape of one node: counter totals and the two latency histograms (cumulative, by upper bound)."""

    t: float  # unix seconds, the monitor's tick (shared by every node scraped in it)
    counters: dict[str, float] = field(default_factory=dict)
    ttft: dict[float, float] = field(default_factory=dict)
    itl: dict[float, float] = field(default_factory=dict)
    has_store: bool = False  # the node runs a KV connector (exports pdserve_kv_* at all)
    created: float | None = None  # unix time the node's TTFT histogram was made: about when it started

    @property
    def output_tokens(self) -> float:
        return self.counters.get("first_tokens", 0.0) + self.counters.get("later_tokens", 0.0)


def parse(text: str, t: float) -> Sample:
    """A Sample from a node's /metrics text; ValueError when it is not the exposition format."""
    sample = Sample(t)
    for family in text_string_to_metric_families(text):
        if family.name.startswith("pdserve_kv_"):
            sample.has_store = True
        for s in family.samples:
            if s.name in COUNTERS:
                key = COUNTERS[s.name]
                sample.counters[key] = sample.counters.get(key, 0.0) + s.value
            elif s.name == f"{TTFT}_created":
                sample.created = s.value if sample.created is None else min(sample.created, s.value)
            elif s.name in (f"{TTFT}_bucket", f"{ITL}_bucket"):
                buckets = sample.ttft if s.name.startswith(TTFT) else sample.itl
                le = float(s.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + s.value
    return sample


def increase(new: float, old: float) -> float:
    return new - old if new >= old else new  # went down: the node restarted, counting from 0


def quantile(q: float, buckets: dict[float, float]) -> float | None:
    """histogram_quantile over cumulative bucket counts {upper bound: count}; None without observations."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for upper in bounds:
        count = buckets[upper]
        if count >= rank:
            if math.isinf(upper):  # beyond the last finite bound: that bound is all we know
                return lower
            return lower + (upper - lower) * (rank - below) / (count - below) if count > below else upper
        lower, below = upper, count
    return lower


def _window(new: dict[float, float], old: dict[float, float]) -> dict[float, float]:
    if any(new.get(le, 0.0) < count for le, count in old.items()):
        return dict(new)  # restarted inside the window
    return {le: count - old.get(le, 0.0) for le, count in new.items()}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3  # unrounded: the page rounds once


class NodeFigures:
    """The samples of one node (HISTORY_S of them) and the figures the status page shows."""

    def __init__(self) -> None:
        self.samples: deque[Sample] = deque()
        self.last_error: str | None = None

    def add(self, sample: Sample) -> None:
        if not self.samples and sample.created is not None and 0 < sample.t - sample.created <= HISTORY_S:
            # A node started within the history: its counters were all 0 then, so what it did before the
            # proxy's first sample (requests sent the moment it came into rotation) is still counted.
            self.samples.append(Sample(sample.created, has_store=sample.has_store))
        self.samples.append(sample)
        while self.samples and sample.t - self.samples[0].t > HISTORY_S + SAMPLE_S:
            self.samples.popleft()

    def _latency(self) -> dict[str, object]:
        """p50/p99 of the increase since the newest sample at least WINDOW_S old, else since the oldest (for
        a node started within the history, its start: `add`)."""
        latest = self.samples[-1]
        base = next((s for s in reversed(self.samples) if latest.t - s.t >= WINDOW_S), self.samples[0])
        out: dict[str, object] = {"window_s": round(latest.t - base.t, 1)}
        for name, new, old in (("ttft_ms", latest.ttft, base.ttft), ("itl_ms", latest.itl, base.itl)):
            window = _window(new, old) if base is not latest else {}
            out[name] = {"p50": _ms(quantile(0.5, window)), "p99": _ms(quantile(0.99, window))}
        return out

    def _history(self) -> dict[str, list]:
        """Per sample after the first: its tick and the increases since the previous sample."""
        cols: dict[str, list] = {"t": [], "seconds": [], "output_tokens": [], "store_hit_tokens": [],
                                 "store_lookup_tokens": []}
        for prev, cur in zip(self.samples, list(self.samples)[1:]):
            cols["t"].append(round(cur.t, 3))
            cols["seconds"].append(round(cur.t - prev.t, 3))
            cols["output_tokens"].append(increase(cur.output_tokens, prev.output_tokens))
            for key, name in (("hit_tokens", "store_hit_tokens"), ("lookup_tokens", "store_lookup_tokens")):
                cols[name].append(increase(cur.counters.get(key, 0.0), prev.counters.get(key, 0.0)))
        return cols

    def status(self) -> dict[str, object] | None:
        """The figures for /status (None before the first sample)."""
        if not self.samples:
            return None
        latest = self.samples[-1]
        c = latest.counters
        store = None
        if latest.has_store:
            lookups = c.get("lookup_tokens", 0.0)
            store = {"hit_rate": c.get("hit_tokens", 0.0) / lookups if lookups else None,
                     **{k: int(c.get(k, 0.0)) for k in ("lookups", "lookup_tokens", "hit_tokens", "loads",
                                                          "loaded_tokens", "fallbacks", "saved_chunks",
                                                          "save_failures")}}
        return {"sampled_at": round(latest.t, 3), "sample_s": SAMPLE_S, "last_error": self.last_error,
                "store": store, "latency": self._latency(), "history": self._history()}
