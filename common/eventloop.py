"""The event loop every pdserve process runs on: uvloop (libuv), as vLLM and SGLang use.

A request through pd-proxy wakes three event loops (client, proxy, node) several times, and on a
small machine those wake-ups and the loop's own per-callback work are a visible part of the
proxy's added latency (benchmarks/pd_vs_monolithic.py --latency-only). uvloop does the same
work in C. `PDSERVE_EVENT_LOOP=asyncio` selects the standard loop instead (to rule uvloop in or
out when chasing a bug); anything else, or unset, means uvloop.
"""
from __future__ import annotations

import asyncio
from typing import Any, Coroutine, TypeVar

from pdserve.common import env

T = TypeVar("T")

ENV = env.EVENT_LOOP.name
CHOICES = ("uvloop", "asyncio")


def loop_kind() -> str:
    """The loop `run` uses: 'uvloop' unless PDSERVE_EVENT_LOOP says 'asyncio'."""
    kind = env.value(env.EVENT_LOOP).strip().lower() or env.EVENT_LOOP.default
    if kind not in CHOICES:
        raise ValueError(f"{ENV} must be one of {', '.join(CHOICES)}, got {kind!r}")
    return kind


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(main) on the chosen loop."""
    if loop_kind() == "asyncio":
        return asyncio.run(main)
    import uvloop  # a dependency (pyproject.toml); imported here so the choice above needs no uvloop

    return uvloop.run(main)
