"""Counters from pdserve `/metrics` endpoints, summed over nodes: the KV hit and load story of a run.

Counter samples (`*_total`) and histogram sums/counts are summed over label sets and over
every URL given, so one number per metric name describes the whole cluster. A URL that does
not answer is reported once and left out; a run against another server simply has none.
"""
from __future__ import annotations

import asyncio
import logging

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from pdserve.bench.client import server_root

logger = logging.getLogger(__name__)

# What the summary and the time plot read (all summed over the nodes scraped).
KV_HIT_TOKENS = "pdserve_kv_hit_tokens_total"
KV_LOADED_TOKENS = "pdserve_kv_loaded_tokens_total"
KV_LOOKUPS = "pdserve_kv_lookups_total"
PREFIX_HITS = "pdserve_prefix_cache_hits_tokens_total"
PREFIX_QUERIES = "pdserve_prefix_cache_queries_tokens_total"
PROMPT_COMPUTED = "pdserve_prompt_tokens_computed_total"


def parse_counters(text: str, prefix: str = "pdserve_") -> dict[str, float]:
    """{sample name: value summed over label sets} of counters and histogram _sum/_count samples."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.type not in ("counter", "histogram", "summary") or not family.name.startswith(prefix):
            continue
        for sample in family.samples:
            if sample.name.endswith(("_total", "_sum", "_count")):
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def metrics_url(base_url: str) -> str:
    """The /metrics URL beside an OpenAI base URL (`http://h:p/v1` -> `http://h:p/metrics`)."""
    return server_root(base_url) + "/metrics"


class Scraper:
    """Scrapes a fixed set of URLs; `snapshot()` is the sum over those that answer."""

    def __init__(self, urls: list[str], timeout_s: float = 5.0, quiet: bool = False) -> None:
        """`quiet`: the URLs are a guess (the endpoint's own /metrics), so one that fails is no news."""
        self.urls = list(urls)
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._warned: set[str] = set(urls) if quiet else set()

    async def _one(self, http: aiohttp.ClientSession, url: str) -> dict[str, float] | None:
        try:
            async with http.get(url, timeout=self.timeout) as resp:
                if resp.status != 200:
                    raise aiohttp.ClientError(f"HTTP {resp.status}")
                return parse_counters(await resp.text())
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            if url not in self._warned:
                self._warned.add(url)
                logger.warning("metrics: %s unavailable (%s)", url, e)
            return None

    async def snapshot(self, http: aiohttp.ClientSession) -> dict[str, float]:
        total: dict[str, float] = {}
        for got in await asyncio.gather(*(self._one(http, u) for u in self.urls)):
            for name, value in (got or {}).items():
                total[name] = total.get(name, 0.0) + value
        return total

    async def keep_answering(self, http: aiohttp.ClientSession) -> None:
        """Drop the URLs that do not answer or export no pdserve metrics (e.g. another server)."""
        answers = await asyncio.gather(*(self._one(http, u) for u in self.urls))
        self.urls = [u for u, got in zip(self.urls, answers) if got]


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in sorted(after)}
