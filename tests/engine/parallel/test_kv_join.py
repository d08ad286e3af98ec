"""Rank 0's join of every rank's part of a KV load or save into one line (engine/parallel/kv_events.py), on
its own: parts in any order, a failed rank's load writes nothing, a part that never comes is written without
it after the deadline and the line says so, replica ranks are not waited for, the table is bounded. The lines
and counters are a real connector's metrics (connectors/kv_metrics.py)."""
from __future__ import annotations

import logging

import pytest

from pdserve.connectors.chunk_math import LoadPlan
from pdserve.connectors.kv_hits import parse_line
from pdserve.connectors.kv_log import load_line, save_line
from pdserve.connectors.kv_metrics import KVTransferMetrics
from pdserve.engine.parallel.kv_events import LOAD, SAVE, KVTransfer, KVTransferJoin

PLAN = LoadPlan(num_tokens=600, num_local=0, hit=600, chunk_size=256)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def load(rid: str, num_bytes: int, seconds: float, codec: str | None = "raw") -> KVTransfer:
    return KVTransfer(LOAD, rid, num_bytes, seconds, codec=codec, plan=(600, 0, 600, 256, 0))


def save(rid: str, num_bytes: int, start: int = 0, end: int = 600) -> KVTransfer:
    return KVTransfer(SAVE, rid, num_bytes, 0.01, start=start, end=end, num_tokens=600, num_chunks=3)


@pytest.fixture()
def metrics(caplog) -> KVTransferMetrics:
    caplog.set_level(logging.INFO, logger="pdserve.connectors.kv_log")
    return KVTransferMetrics("kv_consumer")


def lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "pdserve.connectors.kv_log"]


def join_of(metrics: KVTransferMetrics, clock: Clock, world: int = 2, writers=(0, 1), **kw) -> KVTransferJoin:
    return KVTransferJoin(world, writers, metrics.write, load_timeout_s=5.0, save_timeout_s=7.0, clock=clock, **kw)


def test_a_single_process_connector_writes_its_lines_and_counters_as_before(metrics, caplog):
    metrics.on_load("r", PLAN, 1_000_000, 0.002, "raw")
    metrics.on_save("r", 0, 600, 600, 0, 3, 2_000_000, 0.004)
    assert lines(caplog) == [load_line("r", PLAN, 1_000_000, 0.002, "raw"),
                             save_line("r", 0, 600, 600, 0, 2_000_000, 0.004)]
    assert metrics.value("pdserve_kv_load_bytes_total") == 1_000_000
    assert metrics.value("pdserve_kv_save_bytes_total") == 2_000_000
    assert metrics.value("pdserve_kv_saved_chunks_total") == 3


def test_with_a_sink_the_events_go_there_and_nothing_is_written(metrics, caplog):
    got: list[KVTransfer] = []
    metrics.sink = got.append
    metrics.on_load("r", PLAN, 1_000_000, 0.002, "raw")
    metrics.on_save("r", 0, 600, 600, 0, 3, 2_000_000, 0.004)
    metrics.on_fallback("q", "timeout: no answer within 1s", 5)  # a warning stays the rank's own line
    assert got == [load("r", 1_000_000, 0.002), KVTransfer(SAVE, "r", 2_000_000, 0.004, start=0, end=600,
                                                           num_tokens=600, num_chunks=3)]
    assert [KVTransfer.from_json(e.to_json()) for e in got] == got  # what a rank's report carries
    assert lines(caplog) == ["Reqid: q, KV load failed (timeout: no answer within 1s); recomputing 5 tokens"]
    assert metrics.value("pdserve_kv_load_bytes_total") == 0


def test_parts_join_in_either_order_into_one_line_with_every_ranks_figures(metrics, caplog):
    clock = Clock()
    join = join_of(metrics, clock)
    join.add(1, load("a", 300, 0.004, "int8"))  # the other rank's part first
    join.add(0, load("b", 500, 0.001))  # rank 0's first
    assert lines(caplog) == [] and len(join) == 2
    join.add(0, load("a", 700, 0.002))
    join.add(1, load("b", 500, 0.003))
    assert lines(caplog) == [load_line("a", PLAN, 1000, 0.004, "int8+raw"), load_line("b", PLAN, 1000, 0.003, "raw")]
    assert metrics.value("pdserve_kv_load_bytes_total") == 2000
    assert metrics.value("pdserve_kv_loaded_tokens_total") == 2 * PLAN.need_to_load
    assert len(join) == 0


def test_a_load_failed_on_any_rank_writes_no_load_line(metrics, caplog):
    join = join_of(metrics, Clock())
    join.add(0, load("a", 700, 0.002))
    join.load_failed(1, "a")
    join.load_failed(1, "b")  # the failure first, the other rank's success after
    join.add(0, load("b", 700, 0.002))
    join.load_failed(0, "c")  # rank 0 failed; rank 1's part never comes: settled when every load ended
    join.settle_load("c")
    assert lines(caplog) == [] and len(join) == 0
    assert metrics.value("pdserve_kv_load_bytes_total") == 0


def test_a_missing_part_is_written_after_the_deadline_and_says_so(metrics, caplog):
    clock = Clock()
    join = join_of(metrics, clock)
    join.add(0, load("a", 700, 0.002))
    join.add(0, save("s", 900))
    join.end_round()
    clock.now += 5.0  # the load's deadline, but one report round only: a long step is no reason to give up
    join.end_round()
    assert lines(caplog) == [load_line("a", PLAN, 700, 0.002, "raw") + ", from 1 of 2 ranks"]
    clock.now += 2.0  # the save's deadline (save_timeout_s)
    join.end_round()
    assert lines(caplog)[1] == ("Reqid: s, KV save failed (incomplete: tokens [0, 600) written by 1 of 2 ranks "
                                "(900 bytes) stay uncommitted); the request continues, a consumer will recompute")
    assert len(join) == 0
    assert metrics.value("pdserve_kv_save_bytes_total") == 0  # nothing was committed
    assert metrics.value("pdserve_kv_save_failures_total", reason="incomplete") == 1
    assert metrics.value("pdserve_kv_load_bytes_total") == 700  # what arrived
    event = parse_line("INFO " + lines(caplog)[0])  # pd-kv-hits still reads the line
    assert event is not None and (event.kind, event.request_id, event.values["retrieved"]) == ("load", "a", 600)


def test_a_finished_requests_saves_are_written_when_every_rank_is_done(metrics, caplog):
    join = join_of(metrics, Clock())
    join.add(0, save("s", 900, 0, 256))
    join.add(1, save("s", 900, 0, 256))
    join.add(0, save("s", 400, 256, 600))  # rank 1's part of this range failed (its own warning says so)
    join.add(0, save("t", 400))
    assert lines(caplog) == [save_line("s", 0, 256, 600, 0, 1800, 0.01)]
    join.settle_saves("s")  # every rank's saves of "s" ended: nothing more will come
    assert lines(caplog)[1:] == ["Reqid: s, KV save failed (incomplete: tokens [256, 600) written by 1 of 2 ranks "
                                 "(400 bytes) stay uncommitted); the request continues, a consumer will recompute"]
    assert len(join) == 1  # "t" still waits for rank 1


def test_replica_ranks_are_not_waited_for(metrics, caplog):
    """TP=4 over 2 KV heads: ranks 1 and 3 replicate 0's and 2's heads and save nothing; every rank loads."""
    join = join_of(metrics, Clock(), world=4, writers=(0, 2))
    join.add(0, save("s", 500))
    join.add(1, save("s", 0))  # a replica's empty save is not a part
    join.add(2, save("s", 500))
    assert lines(caplog) == [save_line("s", 0, 600, 600, 0, 1000, 0.01)]
    for rank in range(3):
        join.add(rank, load("a", 250, 0.001))
    assert len(lines(caplog)) == 1  # a load waits for all four
    join.add(3, load("a", 250, 0.001))
    assert lines(caplog)[1] == load_line("a", PLAN, 1000, 0.001, "raw")


def test_the_pending_table_is_bounded(metrics, caplog):
    join = join_of(metrics, Clock(), max_pending=2)
    for rid in "abc":
        join.add(0, load(rid, 100, 0.001))
    assert len(join) == 2
    assert lines(caplog) == [load_line("a", PLAN, 100, 0.001, "raw") + ", from 1 of 2 ranks"]  # the oldest
