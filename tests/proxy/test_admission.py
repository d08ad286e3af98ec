"""Admission control (proxy/admission.py): no wait within the SLO, a bounded queue past it, 429 + Retry-After in
OpenAI's shape beyond it. Driven by a flag the test flips, never by the clock's speed."""
from __future__ import annotations

import asyncio

import pytest

from pdserve.proxy.admission import Admission, AdmissionConfig, Rejected


def test_within_the_slo_nothing_waits() -> None:
    admission = Admission(lambda: False, AdmissionConfig(max_queued=0))
    asyncio.run(admission.admit("r"))
    assert admission.status()["queued"] == 0


def test_past_the_slo_a_full_queue_answers_429_with_retry_after() -> None:
    async def main() -> None:
        saturated = True
        admission = Admission(lambda: saturated, AdmissionConfig(max_queued=2, max_wait_s=600.0))
        waiting = [asyncio.create_task(admission.admit(f"r{i}")) for i in range(2)]
        await asyncio.sleep(0.05)
        assert admission.queued == 2
        with pytest.raises(Rejected) as caught:
            await admission.admit("r2")
        response = caught.value.response()
        assert response.status == 429 and response.headers["Retry-After"] == "600"
        body = caught.value.error.body()["error"]
        assert body["code"] == "rate_limit_exceeded" and body["type"] == "requests" and body["param"] is None
        saturated = False  # the fleet is back within its SLO: the queued ones run
        await asyncio.wait_for(asyncio.gather(*waiting), 600)
        assert admission.status()["admitted_after_wait"] == 2 and admission.queued == 0

    asyncio.run(main())


def test_a_wait_that_runs_out_answers_429() -> None:
    async def main() -> None:
        admission = Admission(lambda: True, AdmissionConfig(max_queued=5, max_wait_s=0.0))
        with pytest.raises(Rejected) as caught:
            await admission.admit("r")
        assert caught.value.retry_after_s == 1 and admission.queued == 0 and admission.rejected == 1

    asyncio.run(main())
