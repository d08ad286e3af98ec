"""The planner's rules on synthetic figures and a synthetic clock (proxy/planner.py): wants, hysteresis, cooldown,
the last node of a role, desired replicas."""
from __future__ import annotations

import pytest

from pdserve.proxy.planner import DECODE, PREFILL, NodeFigure, Planner, PlannerConfig, pressure, want

CFG = PlannerConfig(slo_ttft_ms=100.0, slo_itl_ms=10.0, hysteresis=3, cooldown_s=30.0, history=5)


def fleet(ttft: float | None, itl: float | None, prefill: int = 2, decode: int = 2) -> list[NodeFigure]:
    """`prefill` prefill nodes measuring `ttft`, `decode` decode nodes measuring `itl`; all switchable but p0."""
    return ([NodeFigure(f"p{i}:1", PREFILL, i > 0, i, ttft_p90_ms=ttft) for i in range(prefill)]
            + [NodeFigure(f"d{i}:1", DECODE, True, 5 - i, itl_p90_ms=itl) for i in range(decode)])


def test_pressure_is_latency_over_slo_and_unmeasured_is_idle() -> None:
    assert pressure(fleet(200.0, 5.0), CFG) == {PREFILL: 2.0, DECODE: 0.5}
    assert pressure(fleet(None, None), CFG) == {PREFILL: 0.0, DECODE: 0.0}
    assert pressure(fleet(200.0, 5.0), PlannerConfig(slo_itl_ms=10.0))[PREFILL] == 0.0  # no TTFT SLO


def test_want_moves_towards_the_role_past_its_slo() -> None:
    assert want({PREFILL: 2.0, DECODE: 0.5}, 1.5)[0] == PREFILL
    assert want({PREFILL: 0.5, DECODE: 1.2}, 1.5)[0] == DECODE
    assert want({PREFILL: 0.9, DECODE: 0.9}, 1.5)[0] is None
    assert want({PREFILL: 4.0, DECODE: 2.0}, 1.5)[0] == PREFILL  # both hot: the much worse one
    assert want({PREFILL: 2.5, DECODE: 2.0}, 1.5)[0] is None  # both hot, within the band: no move


def test_a_switch_needs_the_want_for_hysteresis_decisions() -> None:
    planner = Planner(CFG)
    hot_prefill = fleet(300.0, 2.0)
    assert [planner.decide(hot_prefill, t).action for t in (0, 10)] == ["hold", "hold"]
    d = planner.decide(hot_prefill, 20)
    assert d.action == "switch" and d.switch is not None
    # the least loaded switchable decode node moves; targets count it in its new role
    assert (d.switch.address, d.switch.from_role, d.switch.to_role) == ("d1:1", DECODE, PREFILL)
    assert d.targets == {PREFILL: 3, DECODE: 1} and d.current == {PREFILL: 2, DECODE: 2}
    assert "prefill past its TTFT SLO" in d.line() and "pressure 3.00" in d.line()


def test_a_burst_that_flips_resets_the_streak() -> None:
    planner = Planner(CFG)
    for t, figures in enumerate([fleet(300.0, 2.0), fleet(300.0, 2.0), fleet(50.0, 30.0), fleet(300.0, 2.0),
                                 fleet(300.0, 2.0)]):
        assert planner.decide(figures, t * 10).action == "hold"
    assert planner.decide(fleet(300.0, 2.0), 50).action == "switch"


def test_cooldown_after_a_switch() -> None:
    planner = Planner(CFG)
    for t in (0, 10, 20):
        last = planner.decide(fleet(300.0, 2.0, decode=3), t)
    assert last.action == "switch"
    after = fleet(300.0, 2.0, prefill=3, decode=2)
    assert [planner.decide(after, t).action for t in (30, 40)] == ["hold", "hold"]
    assert "cooling down" in planner.decide(after, 49).reason
    assert planner.decide(after, 50).action == "switch"  # 30 s after the first, and the want held all along


def test_a_decision_moves_what_the_role_lacks_within_its_step_of_the_fleet() -> None:
    cfg = PlannerConfig(slo_ttft_ms=100.0, slo_itl_ms=10.0, hysteresis=1, cooldown_s=30.0, max_step=0.125)
    d = Planner(cfg).decide(fleet(125.0, 2.0, prefill=16, decode=16), 0)  # desired ceil(16 x 1.25) = 20
    assert len(d.switches) == 4 and d.switch == d.switches[0] and d.targets == {PREFILL: 20, DECODE: 12}
    assert all(m.from_role == DECODE and m.to_role == PREFILL for m in d.switches)
    assert [m.address for m in d.switches] == ["d15:1", "d14:1", "d13:1", "d12:1"]  # the fewest requests open
    assert d.switches[1].address in d.line()
    assert len(Planner(cfg).decide(fleet(1000.0, 2.0, prefill=16, decode=16), 0).switches) == 4  # the step: 32 / 8
    assert len(Planner(cfg).decide(fleet(101.0, 2.0, prefill=16, decode=16), 0).switches) == 1  # lacks one
    one = PlannerConfig(slo_ttft_ms=100.0, slo_itl_ms=10.0, hysteresis=1, max_step=0.0)
    assert len(Planner(one).decide(fleet(1000.0, 2.0, prefill=16, decode=16), 0).switches) == 1
    every = PlannerConfig(slo_ttft_ms=100.0, slo_itl_ms=10.0, hysteresis=1, max_step=1.0)
    d = Planner(every).decide(fleet(1000.0, 2.0, prefill=2, decode=3), 0)
    assert len(d.switches) == 2 and d.targets == {PREFILL: 4, DECODE: 1}  # the last decode node stays

def test_the_last_node_of_a_role_never_moves_and_fixed_nodes_never_do() -> None:
    planner = Planner(CFG)
    for t in range(5):
        d = planner.decide(fleet(300.0, 2.0, decode=1), t * 100)
    assert d.action == "hold" and "last decode node" in d.reason
    fixed = [NodeFigure("p:1", PREFILL, False, 0, itl_p90_ms=None), NodeFigure("p2:1", PREFILL, False, 0),
             NodeFigure("d:1", DECODE, False, 3, itl_p90_ms=50.0)]
    planner = Planner(CFG)
    for t in range(5):
        d = planner.decide(fixed, t * 100)
    assert d.action == "hold" and "--role auto" in d.reason


def test_desired_replicas_follow_pressure_and_history_is_bounded() -> None:
    planner = Planner(CFG)
    d = planner.decide(fleet(250.0, 4.0, prefill=2, decode=4), 0)
    assert d.desired == {PREFILL: 5, DECODE: 2}  # ceil(2 x 2.5), ceil(4 x 0.4)
    assert planner.decide(fleet(None, None), 1).desired == {PREFILL: 2, DECODE: 2}  # nothing measured: keep
    assert planner.decide(fleet(1e9, 4.0), 2).desired[PREFILL] == CFG.max_desired
    for t in range(10):
        planner.decide(fleet(None, None), t)
    assert len(planner.decisions) == CFG.history


def test_p90_reads_the_window_and_forgets_samples_that_stopped_coming() -> None:
    from pdserve.proxy.node_figures import Sample
    from pdserve.proxy.planner_loop import p90_ms

    old = Sample(0.0, itl={0.01: 0.0, 0.1: 0.0, float("inf"): 0.0})
    burst = Sample(5.0, itl={0.01: 0.0, 0.1: 10.0, float("inf"): 10.0})  # ten gaps between 10 and 100 ms
    calm = Sample(10.0, itl={0.01: 10.0, 0.1: 20.0, float("inf"): 20.0})  # then ten under 10 ms
    assert p90_ms([old, burst], 60.0, "itl", now=5.0) == 91.0  # 10 + 90 x 0.9 (histogram_quantile's rule)
    assert p90_ms([old, burst, calm], 4.0, "itl", now=10.0) == 9.0  # only the last 5 s: the calm ones
    assert p90_ms([old, burst, calm], 60.0, "itl", now=10.0) == pytest.approx(82.0)  # all twenty: 10 + 90 x 0.8
    assert p90_ms([old, burst], 60.0, "itl", now=100.0) is None  # the newest sample is older than the window
    assert p90_ms([old], 60.0, "itl", now=0.0) is None
