"""Chaos with real processes: a slow or frozen store, a killed or frozen decode node, bad input, a
misplaced KV object. Each costs the requests that meet it some time, never another request's
stream and never a token: every request completes with the tokens of a run without the fault.

One cluster (deploy/chaos.py, bench/chaos.py) for the module; each scenario uses its own cache salt, so
no scenario finds another's KV in a prefix cache or the store.
"""
from __future__ import annotations

import asyncio

import pytest

from pdserve.bench.chaos import Outcome, Tally, client_session, request_bodies, run_load, send
from pdserve.deploy.chaos import (LOAD_TIMEOUT_S, STALL_S, ChaosCluster, frozen_decode, killed_decode,
                                  send_malformed, slow_store, stopped, wait_tokens)
from tests.helpers.cluster import log_lines, status
from tests.helpers.timing import HANG_S

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

N = 6  # concurrent streams per scenario
BODIES = request_bodies(N, seed=7)
# The bounds on a running stream's silences are the faults' own lengths, never a figure measured here: a
# stream that waited on the store would be silent for at least that long, one that did not for a step
# or two (milliseconds; a slow, busy machine makes it tenths).
SLOW_REPLY_S = 1.0  # "slow store": every redis reply this late
SLOW_WAIT_S = 2 * SLOW_REPLY_S  # a request's lookup, then its load: what a stream waiting on them would wait
FREEZE_S = 5 * STALL_S  # "frozen decode": how long the node stays stopped; the stall deadline ends the wait first


@pytest.fixture(scope="module")
def chaos(tiny_llama, tmp_path_factory):
    c = ChaosCluster(tiny_llama, tmp_path_factory.mktemp("chaos"))
    yield c
    c.stop()


@pytest.fixture(scope="module")
def reference_run(chaos) -> list[Outcome]:
    """Every request without any fault, on this machine and cluster."""
    outcomes, _ = asyncio.run(run_load(chaos.url, BODIES, "reference", N))
    tally = Tally.of("reference", outcomes, None)
    assert (tally.ok, tally.truncated, dict(tally.failed)) == (N, 0, {})
    return outcomes


@pytest.fixture(scope="module")
def reference(reference_run) -> dict[int, list[int]]:
    """Tokens of every request without any fault."""
    return {o.index: o.token_ids for o in reference_run}


@pytest.fixture()
def healthy(chaos):
    yield chaos
    chaos.healthy()


def check_all_exact(tally: Tally) -> None:
    assert (tally.sent, tally.ok, tally.exact, tally.truncated, dict(tally.failed)) == (N, N, N, 0, {}), tally


def test_frozen_redis_stalls_only_the_requests_that_need_it(healthy, reference):
    """SIGSTOP redis while streams run and new requests arrive: the streams keep their pace, the new
    requests recompute after the lookup deadline; every output exact."""
    chaos = healthy
    newcomers = request_bodies(2, seed=8)

    async def scenario():
        async def fault(progress):
            await wait_tokens(progress, 20)
            with stopped(chaos.redis.proc.pid):
                async with client_session(len(newcomers)) as client:
                    late = await asyncio.gather(*(send(client, chaos.url, i, b, "frozen-late")
                                                  for i, b in enumerate(newcomers)))
            return late
        return await run_load(chaos.url, BODIES, "frozen", N, fault)

    outcomes, late = asyncio.run(scenario())
    tally = Tally.of("redis frozen", outcomes, reference)
    check_all_exact(tally)
    # A stream that needed the frozen store waits one load deadline, then the step that recomputes: under 1.5
    # deadlines (the deadline alone is a race with that step on a busy machine), while waiting out the store
    # twice (a lookup and then a load deadline) or for its thaw would take 2 and more.
    assert tally.worst_gap_s < 1.5 * LOAD_TIMEOUT_S, tally
    quiet, _ = asyncio.run(run_load(chaos.url, newcomers, "frozen-quiet", 2))
    assert [o.token_ids for o in late] == [o.token_ids for o in quiet]
    assert all(o.status == 200 and o.finish_reason == "length" for o in late)


def test_slow_store_costs_no_stream_its_pace(healthy, reference):
    """Every redis reply 1 s late (a delaying TCP relay): lookups, loads and saves wait in the
    background; streams never wait for them."""
    outcomes, _ = asyncio.run(run_load(healthy.url, BODIES, "slow", N, slow_store(healthy, SLOW_REPLY_S, 8.0)))
    tally = Tally.of("redis slow", outcomes, reference)
    check_all_exact(tally)
    assert tally.worst_gap_s < SLOW_WAIT_S, tally


def test_killed_decode_node_streams_resume_elsewhere(healthy, reference):
    """SIGKILL one of two decode nodes mid-stream: its streams continue on the other node from the tokens
    already sent, as one uninterrupted stream with the same tokens."""
    outcomes, _ = asyncio.run(run_load(healthy.url, BODIES, "killed", N, killed_decode(healthy, 30)))
    check_all_exact(Tally.of("decode killed", outcomes, reference))
    proxy_log = healthy.cluster.proxy.out_path.read_text()
    assert "resuming on" in proxy_log


def test_frozen_decode_node_is_noticed_by_its_silence(healthy, reference):
    """SIGSTOP a decode node mid-stream: its streams go silent, the proxy takes it out of rotation within
    the stall deadline and resumes them on the other node."""
    outcomes, _ = asyncio.run(run_load(healthy.url, BODIES, "frozen-node", N, frozen_decode(healthy, FREEZE_S, 30)))
    tally = Tally.of("decode frozen", outcomes, reference)
    check_all_exact(tally)
    assert tally.worst_gap_s < FREEZE_S, tally  # the stall deadline, not the thaw, ended the wait
    assert "silent for" in healthy.cluster.proxy.out_path.read_text()


def test_bad_input_is_a_cheap_4xx_beside_running_streams(healthy, reference, reference_run):
    """Every malformed request of the table is an OpenAI-shaped 4xx, answered sooner than any request is
    served on this machine, while streams run on."""
    async def scenario():
        async def fault(progress):
            await wait_tokens(progress, 10)
            return await send_malformed(healthy.url)
        return await run_load(healthy.url, BODIES, "malformed", N, fault)

    outcomes, results = asyncio.run(scenario())
    check_all_exact(Tally.of("malformed", outcomes, reference))
    wrong = [(what, expected, got, kind) for what, expected, got, kind, _ in results
             if got != expected or kind != "invalid_request_error"]
    assert not wrong, wrong
    served_s = min(o.latency_s for o in reference_run)  # the quickest request served without a fault
    slow = [(what, round(secs, 2)) for what, _, _, _, secs in results if secs > served_s]
    assert not slow, (slow, f"a request is served in {served_s:.2f} s")
    # A header line beyond what the parser reads (32 KiB) is an OpenAI-shaped 400: one log line, no traceback.
    import httpx
    r = httpx.post(healthy.url + "/v1/completions", json={"prompt": [5], "max_tokens": 1},
                   headers={"X-Request-Id": "r" * 40_000})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    proxy_log = healthy.cluster.proxy.out_path.read_text()
    assert "Traceback" not in proxy_log and "refused by the parser (400)" in proxy_log


def test_misplaced_kv_object_is_recomputed(healthy, reference):
    """A valid KV object copied under another chunk's key: the decode node detects it (the object names
    its key) and recomputes; the output is exact."""
    chaos = healthy
    asyncio.run(run_load(chaos.url, BODIES[:1], "misplaced-src", 1))
    assert chaos.misplace_chunk(BODIES[0]["prompt"], "misplaced-src", BODIES[1]["prompt"], "misplaced-dst") > 1
    outcomes, _ = asyncio.run(run_load(chaos.url, BODIES[1:2], "misplaced-dst", 1))
    assert outcomes[0].token_ids == reference[1]
    lines = [line for node in chaos.decode for line in log_lines(node.log_file, "misplaced-dst-0")]
    assert any("KV load failed (corrupt" in line for line in lines), lines
    assert all(n["healthy"] for n in status(chaos.url)["decode"])


def test_no_decode_node_left_ends_each_stream_with_an_error_chunk(chaos, reference):
    """Both decode nodes SIGKILLed mid-stream (runs last: it leaves none): no stream hangs; each either
    finished before, or ends after an exact prefix with an in-band error saying no decode node is left."""
    async def fault(progress):
        await wait_tokens(progress, 20)
        for node in chaos.decode:
            node.kill()

    outcomes, _ = asyncio.run(run_load(chaos.url, BODIES, "all-dead", N, fault))
    tally = Tally.of("all decode killed", outcomes, reference)
    assert tally.truncated + sum(tally.failed.values()) > 0 and tally.exact == tally.ok, tally
    for o in outcomes:
        assert o.latency_s < HANG_S, o  # none ended only at the proxy's token deadline (deploy/chaos.py's TOKEN_S)
        assert o.token_ids == reference[o.index][:len(o.token_ids)], o
        if o.status == 200 and o.finish_reason is None:
            assert o.error is not None and "no_healthy_decode_node" in o.error, o
        elif o.status != 200:
            assert o.status == 503 and "no_healthy_decode_node" in (o.error or ""), o
