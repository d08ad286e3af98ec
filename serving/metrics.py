"""Prometheus metrics of one serving engine, in a registry of its own.

A per-engine CollectorRegistry keeps several engines in one process (tests, a node with
helpers) from clashing over global metric names. Latencies are observed on the event loop;
engine-side totals are read from the latest EngineStats snapshot at scrape time, so the
step thread never touches prometheus objects.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OUTCOMES = ("stop", "length", "abort", "invalid", "rejected", "error")
_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5, 5.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _EngineStatsCollector(Collector):
    """Gauges and totals straight from the engine's last stats snapshot (read at scrape time)."""

    def __init__(self, get_stats: Callable[[], Any], labels: dict[str, str]) -> None:
        self._get_stats = get_stats
        self._labels = labels

    def _family(self, cls, name: str, doc: str, value: float):
        fam = cls(name, doc, labels=list(self._labels))
        fam.add_metric(list(self._labels.values()), value)
        return fam

    def collect(self) -> Iterator:
        s = self._get_stats()
        if s is None:
            return
        g, c = GaugeMetricFamily, CounterMetricFamily
        yield self._family(g, "pdserve_num_requests_running", "Requests in the running batch.", s.num_running)
        yield self._family(g, "pdserve_num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield self._family(g, "pdserve_kv_cache_usage_ratio", "Fraction of KV blocks in use (0..1).", s.kv_usage)
        yield self._family(g, "pdserve_kv_blocks_free", "Free KV blocks (cached-but-free included).",
                           s.num_free_blocks)
        yield self._family(g, "pdserve_kv_blocks_total", "KV blocks in the pool.", s.num_total_blocks)
        yield self._family(c, "pdserve_prefix_cache_queries_tokens", "Prompt tokens looked up in the prefix "
                           "cache.", s.prefix_cache_queries)
        yield self._family(c, "pdserve_prefix_cache_hits_tokens", "Prompt tokens found in the prefix cache.",
                           s.prefix_cache_hits)
        yield self._family(c, "pdserve_num_preemptions", "Requests preempted for lack of KV blocks.",
                           s.num_preemptions)
        yield self._family(c, "pdserve_prompt_tokens_computed", "Prompt tokens run through the model.",
                           s.num_prompt_tokens_computed)


class RequestMetrics:
    """Finished requests by outcome, TTFT / inter-token / end-to-end latencies and token counts, per model:
    the families pd-serve, every node and pd-proxy export alike, so a client scraping any of them sees the same
    names. Observed on the event loop."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["model_name"]
        self._requests = Counter("pdserve_requests", "Finished generation requests (HTTP or gRPC) by outcome.",
                                 [*labels, "outcome"], registry=registry)
        self._ttft = Histogram("pdserve_time_to_first_token_seconds", "Arrival to first output token.", labels,
                               buckets=_TTFT_BUCKETS, registry=registry)
        self._itl = Histogram("pdserve_inter_token_latency_seconds", "Time between consecutive output tokens.",
                              labels, buckets=_ITL_BUCKETS, registry=registry)
        self._e2e = Histogram("pdserve_e2e_request_latency_seconds", "Arrival to the last output token.", labels,
                              buckets=_E2E_BUCKETS, registry=registry)
        self._prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens of finished requests.", labels,
                                      registry=registry)
        self._generation_tokens = Counter("pdserve_generation_tokens", "Output tokens of finished requests.", labels,
                                          registry=registry)
        self._models: set[str] = set()

    def add_model(self, model: str) -> None:
        """Every outcome's series of `model`, at 0 until counted (a rate over them then starts at once)."""
        if model not in self._models:
            self._models.add(model)
            for outcome in OUTCOMES:
                self._requests.labels(model, outcome)

    def record_outcome(self, model: str, outcome: str) -> None:
        self.add_model(model)
        self._requests.labels(model, outcome).inc()

    def observe_tokens(self, model: str, since_last: float, num_tokens: int, first: bool) -> None:
        """One output delta: `since_last` is from arrival (first delta) or from the previous delta."""
        if first:
            self._ttft.labels(model).observe(since_last)
            num_tokens -= 1
            since_last = 0.0
        itl = self._itl.labels(model)
        for _ in range(num_tokens):  # a delta with k tokens: k inter-token gaps of equal share
            itl.observe(since_last / num_tokens)

    def observe_finished(self, model: str, e2e_s: float, prompt_tokens: int, output_tokens: int) -> None:
        self._e2e.labels(model).observe(e2e_s)
        self._prompt_tokens.labels(model).inc(prompt_tokens)
        self._generation_tokens.labels(model).inc(output_tokens)


class EngineMetrics:
    """One engine's RequestMetrics under its served name, plus the engine stats collector."""

    def __init__(self, model_name: str, get_stats: Callable[[], Any] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._model = model_name
        self.requests = RequestMetrics(self.registry)
        self.requests.add_model(model_name)
        if get_stats is not None:
            self.registry.register(_EngineStatsCollector(get_stats, {"model_name": model_name}))

    def record_outcome(self, outcome: str) -> None:
        self.requests.record_outcome(self._model, outcome)

    def observe_tokens(self, since_last: float, num_tokens: int, first: bool) -> None:
        self.requests.observe_tokens(self._model, since_last, num_tokens, first)

    def observe_finished(self, e2e_s: float, prompt_tokens: int, output_tokens: int) -> None:
        self.requests.observe_finished(self._model, e2e_s, prompt_tokens, output_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ProxyMetrics(Collector):
    """The proxy's own requests (`requests`: pd-serve's families, as its clients saw them) and its per-node
    routing state, read from its node handles at scrape time.

    `get_nodes` returns objects with `role`, `address`, `routed`, `healthy` and `load.in_flight`
    (proxy/health.py's Node); the request path keeps counting on them and never touches Prometheus.
    """

    def __init__(self, get_nodes: Callable[[], Iterable[Any]]) -> None:
        self._get_nodes = get_nodes
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = RequestMetrics(self.registry)
        self.registry.register(self)

    def collect(self) -> Iterator:
        labels = ["role", "node"]
        routed = CounterMetricFamily("pdserve_proxy_routed_requests", "Requests the proxy sent to each node "
                                     "(prefill and decode calls, retries included).", labels=labels)
        in_flight = GaugeMetricFamily("pdserve_proxy_in_flight_requests", "Requests the proxy has open on "
                                      "each node.", labels=labels)
        healthy = GaugeMetricFamily("pdserve_proxy_node_healthy", "1 while the node is in rotation, 0 while "
                                    "it is out (failed health check or request).", labels=labels)
        for node in self._get_nodes():
            key = [node.role, node.address]
            routed.add_metric(key, node.routed)
            in_flight.add_metric(key, node.load.in_flight)
            healthy.add_metric(key, 1.0 if node.healthy else 0.0)
        yield from (routed, in_flight, healthy)

    def render(self) -> bytes:
        return generate_latest(self.registry)
