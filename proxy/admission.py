"""Admission control: while every decode node is past its ITL SLO, new requests wait in a bounded queue.

Letting every request in while the decode fleet is past its SLO makes every stream slower (they share
the decode steps), so the proxy holds new requests instead: up to `max_queued` wait, each at most
`max_wait_s`, for the fleet to come back within its SLO; one more, or one whose wait runs out, is answered
429 with `Retry-After` in OpenAI's error shape (a client library backs off and retries). A request that
found the fleet within its SLO never waits. `saturated()` is the proxy's reading of its decode nodes
(proxy/planner_loop.py: their ITL p90 over the planner's window, each against `--slo-itl-ms`).
"""
from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass
from typing import Callable

from aiohttp import web

from pdserve.serving.protocol import APIError

logger = logging.getLogger(__name__)

POLL_S = 0.1  # how often a queued request looks at whether the fleet is back within its SLO


class Rejected(Exception):
    """A request admission turned away: its 429 and how long the client should wait before retrying."""

    def __init__(self, error: APIError, retry_after_s: int) -> None:
        super().__init__(error.message)
        self.error = error
        self.retry_after_s = retry_after_s

    def response(self) -> web.Response:
        return web.json_response(self.error.body(), status=self.error.status,
                                 headers={"Retry-After": str(self.retry_after_s)})


def too_many_requests(message: str) -> APIError:
    """OpenAI's rate-limit error body (its Python client raises RateLimitError and backs off on it)."""
    return APIError(429, message, type="requests", code="rate_limit_exceeded")


@dataclass(frozen=True)
class AdmissionConfig:
    max_queued: int = 64  # --max-queued-requests
    max_wait_s: float = 10.0  # --max-queue-wait: a queued request's bound, and the Retry-After of a 429


class Admission:
    def __init__(self, saturated: Callable[[], bool], config: AdmissionConfig = AdmissionConfig()) -> None:
        self.saturated = saturated
        self.max_queued = config.max_queued
        self.max_wait_s = config.max_wait_s
        self.queued = 0  # requests waiting now
        self.admitted_after_wait = 0
        self.rejected = 0

    @property
    def retry_after_s(self) -> int:
        return max(1, math.ceil(self.max_wait_s))

    async def admit(self, rid: str) -> None:
        """Return when `rid` may run; Rejected when the queue is full or its wait ran out."""
        if not self.saturated():
            return
        if self.queued >= self.max_queued:
            self.rejected += 1
            logger.warning("Reqid: %s, rejected: every decode node past its ITL SLO and %d requests queued "
                           "(--max-queued-requests); Retry-After %d s", rid, self.queued, self.retry_after_s)
            raise Rejected(too_many_requests(
                f"Every decode node is past its latency SLO and {self.queued} requests are queued; "
                f"retry after {self.retry_after_s} s"), self.retry_after_s)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        self.queued += 1
        try:
            while self.saturated():
                if loop.time() - t0 >= self.max_wait_s:
                    self.rejected += 1
                    logger.warning("Reqid: %s, rejected: waited %.1f s in the admission queue, every decode node "
                                   "still past its ITL SLO; Retry-After %d s", rid, loop.time() - t0,
                                   self.retry_after_s)
                    raise Rejected(too_many_requests(
                        f"Every decode node stayed past its latency SLO for {self.max_wait_s:g} s; retry after "
                        f"{self.retry_after_s} s"), self.retry_after_s)
                await asyncio.sleep(POLL_S)
        finally:
            self.queued -= 1
        self.admitted_after_wait += 1
        logger.info("Reqid: %s, admitted after %.1f ms in the admission queue", rid, (loop.time() - t0) * 1e3)

    def status(self) -> dict[str, object]:
        return {"queued": self.queued, "max_queued": self.max_queued, "max_wait_s": self.max_wait_s,
                "saturated": self.saturated(), "admitted_after_wait": self.admitted_after_wait,
                "rejected": self.rejected}
