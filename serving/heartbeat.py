"""Heartbeats on a stream that has nothing to say yet: how a caller tells "busy" from "frozen".

A decode node's Generate stream may stay quiet for a long time with good reason (the request
waits in the queue, its KV loads, a long prefill runs). The node therefore sends an empty
message every `interval_s` while it has nothing else to send; the proxy treats a stream that
stays silent much longer than that as a frozen node (proxy/decode_stream.py), whatever the
request is waiting for.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, TypeVar

T = TypeVar("T")

HEARTBEAT_S = 1.0


async def with_heartbeat(items: AsyncIterator[T], interval_s: float = HEARTBEAT_S) -> AsyncIterator[T | None]:
    """Yield every item of `items`, and None whenever `interval_s` passes without one."""
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(items))
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield None
                continue
            future, pending = pending, None
            try:
                item = future.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:  # the caller left: stop the producer where it waits
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        aclose = getattr(items, "aclose", None)
        if aclose is not None:
            await aclose()
