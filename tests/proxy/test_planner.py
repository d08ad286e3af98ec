"""The planner's rules on synthetic figures and a synthetic clock (proxy/planner.py): wants, the lead move before a
breach, hysteresis, cooldown, waiting for switched nodes to land, recovery, the last node of a role, desired replicas,
and no node moved back and forth under noisy figures."""
from __future__ import annotations

import random

import pytest

from pdserve.proxy.planner import DECODE, PREFILL, NodeFigure, Planner, PlannerConfig, load, pressure, want

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
    assert want({PREFILL: 2.0, DECODE: 0.5}, CFG)[:3:2] == (PREFILL, False)
    assert want({PREFILL: 0.5, DECODE: 1.2}, CFG)[0] == DECODE
    assert want({PREFILL: 0.9, DECODE: 0.9}, CFG)[0] is None
    assert want({PREFILL: 4.0, DECODE: 2.0}, CFG)[0] == PREFILL  # both hot: the much worse one
    assert want({PREFILL: 2.5, DECODE: 2.0}, CFG)[0] is None  # both hot, within the band: no move


def test_want_leads_towards_a_rising_role_near_its_slo_from_one_with_slack() -> None:
    up, flat = {PREFILL: 0.1, DECODE: 0.0}, {PREFILL: 0.0, DECODE: 0.0}
    near = {PREFILL: 0.85, DECODE: 0.3}
    assert want(near, CFG, up, flat)[:3:2] == (PREFILL, True)
    assert want(near, CFG, flat, {PREFILL: 0.5, DECODE: 0.0})[0] == PREFILL  # its queue grew: rising too
    assert want(near, CFG)[0] is None  # no trend yet (the first decision)
    assert want(near, CFG, {PREFILL: -0.1, DECODE: 0.0}, flat)[0] is None  # falling: it is getting better
    assert want({PREFILL: 0.85, DECODE: 0.6}, CFG, up, flat)[0] is None  # decode has no slack to give
    assert want({PREFILL: 0.7, DECODE: 0.3}, CFG, up, flat)[0] is None  # not near enough
    assert want(near, PlannerConfig(slo_ttft_ms=100.0, slo_itl_ms=10.0, lead=0.0), up, flat)[0] is None  # off


def test_load_is_outstanding_requests_per_node() -> None:
    assert load(fleet(None, None, prefill=2, decode=2)) == {PREFILL: 0.5, DECODE: 4.5}
    assert load([]) == {PREFILL: 0.0, DECODE: 0.0}


def test_a_lead_moves_one_node_before_the_slo_breaks() -> None:
    planner = Planner(PlannerConfig(slo_ttft_ms=100.0, slo_itl_ms=10.0, max_step=1.0))
    assert planner.decide(fleet(60.0, 3.0, prefill=8, decode=8), 0).action == "hold"  # both within, no trend yet
    assert planner.decide(fleet(70.0, 3.0, prefill=8, decode=8), 5).action == "hold"  # rising, but at 0.7
    d = planner.decide(fleet(85.0, 3.0, prefill=8, decode=8), 10)
    assert d.action == "switch" and len(d.switches) == 1 and d.switch is not None and d.switch.to_role == PREFILL
    assert d.pressure[PREFILL] < 1.0 and "prefill nearing its TTFT SLO and rising" in d.line()
    assert "+0.15" in d.line() and "landing 0" in d.line()
    # a donor that one node fewer would bring near its own SLO keeps its nodes
    planner = Planner(PlannerConfig(slo_ttft_ms=100.0, slo_itl_ms=10.0))
    planner.decide(fleet(70.0, 4.5, prefill=2, decode=2), 0)
    d = planner.decide(fleet(90.0, 4.5, prefill=2, decode=2), 5)
    assert d.action == "hold" and "decode would reach the lead (0.8) with one node fewer" in d.reason


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


def landed(figures: list[NodeFigure], address: str, role: str) -> list[NodeFigure]:
    """`figures` with the node at `address` in `role` (a switch carried out)."""
    return [NodeFigure(f.address, role, f.switchable, f.outstanding, f.ttft_p90_ms, f.itl_p90_ms)
            if f.address == address else f for f in figures]


def test_cooldown_after_a_switch() -> None:
    planner = Planner(CFG)
    for t in (0, 10, 20):
        last = planner.decide(fleet(300.0, 2.0, decode=3), t)
    assert last.action == "switch" and last.switch is not None
    after = landed(fleet(300.0, 2.0, decode=3), last.switch.address, PREFILL)
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
    assert len(Planner(cfg).decide(fleet(101.0, 2.0, prefill=16, decode=16), 0).switches) == 4  # 16 x 1.01 / 0.8
    breach_only = PlannerConfig(slo_ttft_ms=100.0, slo_itl_ms=10.0, hysteresis=1, max_step=0.125, lead=0.0)
    assert len(Planner(breach_only).decide(fleet(101.0, 2.0, prefill=16, decode=16), 0).switches) == 1  # to 1.0
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


def test_no_switch_while_the_last_ones_have_not_landed() -> None:
    planner = Planner(PlannerConfig(slo_ttft_ms=100.0, slo_itl_ms=10.0, cooldown_s=0.0))
    d = planner.decide(fleet(300.0, 2.0, decode=3), 0)
    assert d.action == "switch" and d.switch is not None
    moving = [f for f in fleet(300.0, 2.0, decode=3) if f.address != d.switch.address]  # out of rotation
    d2 = planner.decide(moving, 5)
    assert d2.action == "hold" and "1 switched node(s) not yet in their new role" in d2.reason and d2.landing == 1
    back = landed(fleet(300.0, 2.0, decode=3), d.switch.address, PREFILL)
    d3 = planner.decide(back, 10)  # landed: its effect is not in the window yet
    assert d3.action == "hold" and "arrived within the window" in d3.reason
    worse = [NodeFigure(f.address, f.role, f.switchable, f.outstanding, 400.0 if f.role == PREFILL else None,
                        f.itl_p90_ms) for f in back]
    assert planner.decide(worse, 15).action == "switch"  # ... unless it is still getting worse
    # a node that never shows up again holds the planner no longer than a drain's bound
    planner = Planner(PlannerConfig(slo_ttft_ms=100.0, slo_itl_ms=10.0, cooldown_s=0.0, drain_timeout_s=20.0))
    gone = planner.decide(fleet(300.0, 2.0, decode=3), 0).switch
    assert gone is not None
    moving = [f for f in fleet(300.0, 2.0, decode=3) if f.address != gone.address]
    assert planner.decide(moving, 15).action == "hold" and planner.decide(moving, 21).action == "switch"


def test_a_role_past_its_slo_but_recovering_waits() -> None:
    planner = Planner(PlannerConfig(slo_ttft_ms=100.0, slo_itl_ms=10.0, hysteresis=2, cooldown_s=0.0))
    assert planner.decide(fleet(300.0, 2.0, prefill=4, decode=4), 0).action == "hold"  # 1 of 2
    falling = [NodeFigure(f.address, f.role, f.switchable, max(0, f.outstanding - 1), 250.0 if f.role == PREFILL
                          else None, f.itl_p90_ms) for f in fleet(300.0, 2.0, prefill=4, decode=4)]
    d = planner.decide(falling, 5)
    assert d.action == "hold" and "recovering" in d.reason and d.trend[PREFILL] == pytest.approx(-0.5)
    assert "past its TTFT SLO" in d.reason  # the want stands: it moves again if the fall stops
    assert planner.decide(falling, 10).action == "switch"


def test_a_breach_takes_no_more_than_keeps_the_donor_within_its_slo() -> None:
    cfg = PlannerConfig(slo_ttft_ms=100.0, slo_itl_ms=10.0, max_step=1.0)
    d = Planner(cfg).decide(fleet(300.0, 7.0, prefill=8, decode=8), 0)  # 8 x 3.0 / 0.8 = 30: 16 (all) wanted
    assert len(d.switches) == 2  # decode at 0.7 x 8 / 6 = 0.93; a third would put it at 1.12
    assert d.to_json()["load"] == {PREFILL: 3.5, DECODE: 1.5}


def test_noisy_figures_never_move_a_node_back_within_a_phase() -> None:
    """A fleet whose latency is demand / nodes, with ±20% noise on every reading: each phase moves its nodes
    one way, and the switch back comes only with the next phase."""
    rng = random.Random(7)
    planner = Planner(PlannerConfig(slo_ttft_ms=100.0, slo_itl_ms=10.0))
    roles = {f"n{i}:1": PREFILL if i < 16 else DECODE for i in range(32)}
    directions: list[str] = []
    for t in range(0, 1200, 5):
        demand = {PREFILL: 20.0, DECODE: 5.0} if t < 600 else {PREFILL: 3.0, DECODE: 20.0}  # node-SLOs of work
        count = {r: list(roles.values()).count(r) for r in (PREFILL, DECODE)}
        if t == 600:
            assert count[PREFILL] >= 20  # the first phase's needs met
        reading = {r: demand[r] / count[r] * rng.uniform(0.8, 1.2) for r in (PREFILL, DECODE)}
        figures = [NodeFigure(a, r, True, rng.randint(0, 3), ttft_p90_ms=100 * reading[r] if r == PREFILL else None,
                              itl_p90_ms=10 * reading[r] if r == DECODE else None) for a, r in roles.items()]
        for m in planner.decide(figures, t).switches:
            roles[m.address] = m.to_role
            directions.append(m.to_role)
    prefill, decode = list(roles.values()).count(PREFILL), list(roles.values()).count(DECODE)
    flips = sum(a != b for a, b in zip(directions, directions[1:]))
    assert flips == 1 and directions[0] == PREFILL and directions[-1] == DECODE, directions
    assert prefill >= 3 and decode >= 20  # the second phase's needs met


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
