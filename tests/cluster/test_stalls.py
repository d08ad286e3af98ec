"""One decode node that pauses or dies mid-stream: its streams wait for it, bounded, and go on.

A real P/D cluster with a single decode node (deploy/chaos.py's, with redis behind its relay); every fault is
real: SIGSTOP then SIGCONT of the node's process (`kill -STOP; sleep; kill -CONT`), or SIGKILL and a restart.
With no other decode node to resume on, pd-proxy waits for the node up to --decode-recovery-timeout of
silence instead of failing every stream at the stall deadline (proxy/decode_stream.py): it reads on when a
paused node answers again, and resumes on the node once it is back in rotation when its stream broke. Every
stream ends with all its tokens, equal to a run without the fault; none is lost or sent twice.
"""
from __future__ import annotations

import asyncio

import pytest

from pdserve.bench.chaos import Tally, request_bodies, run_load
from pdserve.deploy.chaos import STALL_S, ChaosCluster, stopped, wait_tokens

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

N = 6  # concurrent streams
# Long enough that every stream is still running when the fault lands, whatever the machine's pace.
BODIES = request_bodies(N, seed=11, max_tokens_range=(256, 256))
PAUSE_S = 3.5 * STALL_S  # the pause: past the stall deadline, shorter than the recovery bound
RECOVERY_S = 120.0  # pd-proxy --decode-recovery-timeout here: past any pause or restart below


@pytest.fixture(scope="module")
def lone(tiny_llama, tmp_path_factory):
    c = ChaosCluster(tiny_llama, tmp_path_factory.mktemp("stalls"), num_decode=1,
                     proxy_args=["--decode-recovery-timeout", str(RECOVERY_S)])
    yield c
    c.stop()


@pytest.fixture(scope="module")
def reference(lone) -> dict[int, list[int]]:
    outcomes, _ = asyncio.run(run_load(lone.url, BODIES, "reference", N))
    tally = Tally.of("reference", outcomes, None)
    assert (tally.ok, tally.truncated, dict(tally.failed)) == (N, 0, {})
    return {o.index: o.token_ids for o in outcomes}


@pytest.fixture()
def healthy(lone):
    yield lone
    lone.healthy()


def check_all_exact(tally: Tally) -> None:
    assert (tally.sent, tally.ok, tally.exact, tally.truncated, dict(tally.failed)) == (N, N, N, 0, {}), tally


def test_a_paused_lone_decode_node_keeps_its_streams(healthy, reference):
    """`kill -STOP <decode>; sleep 7; kill -CONT <decode>` with streams running: past the 2 s stall deadline
    the proxy waits for the only decode node instead of failing its streams, and every stream ends whole."""
    async def pause(progress):
        await wait_tokens(progress, N * 10)
        with stopped(healthy.decode[0].proc.pid):
            await asyncio.sleep(PAUSE_S)

    outcomes, _ = asyncio.run(run_load(healthy.url, BODIES, "paused", N, pause))
    tally = Tally.of("lone decode paused", outcomes, reference)
    check_all_exact(tally)
    assert tally.worst_gap_s >= STALL_S, tally  # the pause reached the streams: they waited past the stall deadline
    proxy_log = healthy.cluster.proxy.out_path.read_text()
    assert "no other decode node can take the stream" in proxy_log


def test_a_lone_decode_node_killed_and_restarted_takes_its_streams_back(healthy, reference):
    """SIGKILL of the only decode node mid-stream, then a restart: each stream resumes on it once it is back in
    rotation, with the tokens an uninterrupted run has."""
    node = healthy.decode[0]

    async def restart(progress):
        await wait_tokens(progress, N * 10)
        node.kill()
        await asyncio.to_thread(node.proc.wait)
        node.start()

    outcomes, _ = asyncio.run(run_load(healthy.url, BODIES, "restarted", N, restart))
    check_all_exact(Tally.of("lone decode restarted", outcomes, reference))
    proxy_log = healthy.cluster.proxy.out_path.read_text()
    assert "no decode node can take the stream" in proxy_log and "back in rotation" in proxy_log
    assert "resuming on" in proxy_log
