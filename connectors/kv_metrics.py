"""Prometheus metrics of the KV hand-off, and the one place each hand-off event is reported.

Every connector reports through `KVTransferMetrics`, so the store and LMCache connectors print
the same lines (kv_log.py) and export the same series. Each connector owns a private registry
(several engines can live in one process); a server exposes it by registering the object as a
collector. Under TP/PP each rank's connector moves its own part of a request's KV: its loads and
saves go to a `sink` instead, and rank 0 writes one line per event with every rank's figures
(engine/parallel/kv_events.py).
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import Metric

from pdserve.connectors.chunk_math import LoadPlan
from pdserve.connectors.kv_log import (adapter_note, fallback_line, load_line, logger, lookup_line, parts_note,
                                       save_line)
from pdserve.engine.parallel.kv_events import LOAD, SAVE, KVTransfer

_KEPT_SAVE_FAILURES = 1024  # requests whose save failure waits to be asked about (take_save_failure)
_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class KVTransferMetrics:
    """Counters and histograms of one connector, usable as a prometheus_client collector."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.registry = CollectorRegistry()
        r = self.registry
        self.lookups = Counter("pdserve_kv_lookups", "Store lookups of prompts", registry=r)
        self.lookup_tokens = Counter("pdserve_kv_lookup_tokens", "Prompt tokens of the store lookups (T): the "
                                     "store hit rate is pdserve_kv_hit_tokens / this", registry=r)
        self.hit_tokens = Counter("pdserve_kv_hit_tokens", "Prompt tokens covered by present chunks (H)",
                                  registry=r)
        self.loaded_tokens = Counter("pdserve_kv_loaded_tokens", "Tokens written into paged KV from the store",
                                     registry=r)
        self.retrieved_tokens = Counter("pdserve_kv_retrieved_tokens", "Tokens read from the store (whole chunks)",
                                        registry=r)
        self.load_bytes = Counter("pdserve_kv_load_bytes", "Bytes read from the store", registry=r)
        self.load_seconds = Histogram("pdserve_kv_load_seconds",
                                      "Time from a request's load start to its last copy (overlaps compute)",
                                      buckets=_SECONDS_BUCKETS, registry=r)
        self.saved_tokens = Counter("pdserve_kv_saved_tokens", "Tokens written to the store", registry=r)
        self.saved_chunks = Counter("pdserve_kv_saved_chunks", "Chunks committed to the store", registry=r)
        self.save_bytes = Counter("pdserve_kv_save_bytes", "Bytes written to the store", registry=r)
        self.save_seconds = Histogram("pdserve_kv_save_seconds", "I/O time to save one request's chunks of a step",
                                      buckets=_SECONDS_BUCKETS, registry=r)
        self.save_failures = Counter("pdserve_kv_save_failures", "Saves given up (the request still succeeds)",
                                     ["reason"], registry=r)
        self.fallbacks = Counter("pdserve_kv_fallbacks", "Lookups or loads that failed and were recomputed",
                                 ["reason"], registry=r)
        # Set on every rank of a parallel engine: a load or save is handed to it instead of being written
        # (its line and counters), and rank 0 writes the ranks' joined parts (engine/parallel/kv_ranks.py).
        self.sink: Callable[[KVTransfer], None] | None = None
        # Request id -> why its save failed, until the server asks (a prefill node's "prefill done" line must
        # not say the KV is committed): written on the step thread, taken on the event loop.
        self._save_failures: dict[str, str] = {}
        self._save_failures_lock = threading.Lock()

    def collect(self) -> Iterable[Metric]:
        """Lets a server do `registry.register(connector.metrics)`."""
        return self.registry.collect()

    def value(self, name: str, **labels: str) -> float:
        """Current value of one sample (tests and benchmarks read counters through this)."""
        got = self.registry.get_sample_value(name, labels or None)
        return got or 0.0

    # ---- events: one log line and the matching counters each ----
    def on_lookup(self, request_id: str, plan: LoadPlan, adapter: str | None = None) -> None:
        self.lookups.inc()
        self.lookup_tokens.inc(plan.num_tokens)
        self.hit_tokens.inc(plan.hit)
        logger.info(lookup_line(request_id, plan) + adapter_note(adapter))

    def on_load(self, request_id: str, plan: LoadPlan, num_bytes: int, seconds: float,
                codec: str | None = None, adapter: str | None = None) -> None:
        self._report(KVTransfer(LOAD, request_id, num_bytes, seconds, codec=codec,
                                plan=(plan.num_tokens, plan.num_local, plan.hit, plan.chunk_size, plan.num_outputs),
                                adapter=adapter))

    def on_save(self, request_id: str, start: int, end: int, num_tokens: int, skip_leading_tokens: int,
                num_chunks: int, num_bytes: int, seconds: float, adapter: str | None = None) -> None:
        self._report(KVTransfer(SAVE, request_id, num_bytes, seconds, start=start, end=end, num_tokens=num_tokens,
                                skip_leading_tokens=skip_leading_tokens, num_chunks=num_chunks, adapter=adapter))

    def _report(self, event: KVTransfer) -> None:
        if self.sink is not None:
            self.sink(event)
        else:
            self.write(event)

    def write(self, event: KVTransfer, parts: tuple[int, int] | None = None) -> None:
        """A load's or save's counters and its line. `parts`: (arrived, expected) for a parallel engine's
        event some ranks' parts never reached: a load's line says so; such a save committed nothing (the
        commit waits for every writing rank's part), so it is a save failure, not a Stored line."""
        note = parts_note(*parts) if parts else ""
        if event.kind == LOAD:
            plan = LoadPlan(*event.plan)
            self.loaded_tokens.inc(plan.need_to_load)
            self.retrieved_tokens.inc(plan.retrieved)
            self.load_bytes.inc(event.num_bytes)
            self.load_seconds.observe(event.seconds)
            logger.info(load_line(event.request_id, plan, event.num_bytes, event.seconds, event.codec)
                        + adapter_note(event.adapter) + note)
            return
        if parts:  # a writing rank's part never came: its objects are missing, so the chunks stay uncommitted
            self.on_save_failure(event.request_id, f"incomplete: tokens [{event.start}, {event.end}) written by "
                                 f"{parts[0]} of {parts[1]} ranks ({event.num_bytes} bytes) stay uncommitted")
            return
        self.saved_tokens.inc(event.end - event.start)
        self.saved_chunks.inc(event.num_chunks)
        self.save_bytes.inc(event.num_bytes)
        self.save_seconds.observe(event.seconds)
        logger.info(save_line(event.request_id, event.start, event.end, event.num_tokens, event.skip_leading_tokens,
                              event.num_bytes, event.seconds) + adapter_note(event.adapter))

    def on_save_failure(self, request_id: str, reason: str) -> None:
        self.save_failures.labels(reason=_reason_label(reason)).inc()
        logger.warning(f"Reqid: {request_id}, KV save failed ({reason}); the request continues, "
                       "a consumer will recompute")
        with self._save_failures_lock:
            self._save_failures.setdefault(request_id, reason)  # the first reason: what went wrong first
            while len(self._save_failures) > _KEPT_SAVE_FAILURES:  # never asked about: the oldest go
                del self._save_failures[next(iter(self._save_failures))]

    def take_save_failure(self, request_id: str) -> str | None:
        """Why a save of `request_id` failed (None: none did), forgotten once asked."""
        with self._save_failures_lock:
            return self._save_failures.pop(request_id, None)

    def on_fallback(self, request_id: str, reason: str, num_tokens: int) -> None:
        self.fallbacks.labels(reason=_reason_label(reason)).inc()
        logger.warning(fallback_line(request_id, reason, num_tokens))


def _reason_label(reason: str) -> str:
    """Low-cardinality label: the reason's first word (e.g. 'timeout', 'unavailable', 'corrupt')."""
    return reason.split(":", 1)[0].split(" ", 1)[0].lower() or "unknown"
