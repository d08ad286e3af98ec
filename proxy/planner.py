"""The planner: how many nodes each role should have, and which `--role auto` node to move next.

Pure logic, no I/O: `Planner.decide(figures, now)` reads one `NodeFigure` per node (its role, whether it
can switch, its outstanding requests, its TTFT and ITL p90 over the last window) against the SLOs, and
returns a `Decision`. The proxy's driver (proxy/planner_loop.py) feeds it from what it samples and carries
out the switch; a simulator (benchmarks/fleet_sim.py) can feed it synthetic figures and a synthetic clock.

A role's *pressure* is its latency over its SLO: prefill's mean TTFT p90 / `slo_ttft_ms`, decode's mean
ITL p90 / `slo_itl_ms` (over the nodes that measured any; none measured: 0, idle). The planner wants a
node moved towards a role past its SLO while the other is within its own, or, both past, towards the one
whose pressure is more than `band` times the other's. Hysteresis, so a burst never flaps a node back and
forth: the same want must hold for `hysteresis` consecutive decisions, a switch is followed by
`cooldown_s` without another, and the last node of a role never moves. A decision moves as many nodes as the
role is short of its `desired` count, at most `max_step` of the fleet (at least one node): a 32-node fleet whose
mix shifts needs a dozen moves within minutes, one node per decision and cooldown takes a quarter of an hour.

`desired` is what a Kubernetes autoscaler should run per role (HPA's rule, current × pressure, at least
one; a role without figures keeps its count): the `pdserve_planner_desired_replicas` gauge.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass, field

PREFILL, DECODE = "prefill", "decode"
ROLES = (PREFILL, DECODE)


@dataclass(frozen=True)
class PlannerConfig:
    slo_ttft_ms: float | None = None  # None: prefill's pressure is never measured (0)
    slo_itl_ms: float | None = None
    # The defaults are benchmarks/fleet_sim.py's choice on its shifting trace (docs/benchmarks.md, "Fleet scale"):
    # a shift that needs a dozen moves must see them within a minute or two, and the previous 10 s / 60 s window /
    # hysteresis 3 / 60 s cooldown / one node per decision kept 0.04-0.7x of the best static split where it did.
    interval_s: float = 5.0  # between two decisions
    window_s: float = 10.0  # the latency percentiles' window (the driver's; the planner sees p90s): the burst guard
    hysteresis: int = 1  # consecutive decisions with the same want before a switch
    cooldown_s: float = 10.0  # after a switch, none before this (the moved nodes' figures need to settle)
    max_step: float = 0.0625  # share of the fleet one decision may move (at least one node; 0: one per decision):
                              # at 0.125 a 32-node fleet overshot and swung back and forth (148 switches in 600 s)
    band: float = 1.5  # both roles past their SLOs: move only when one's pressure is this many times the other's
    drain_timeout_s: float = 60.0  # a switching node's bound on finishing its old role's calls
    history: int = 20  # decisions GET /planner keeps
    max_desired: int = 64  # the gauge's cap: a latency far past its SLO must not ask an autoscaler for millions

    @property
    def enabled(self) -> bool:
        return self.slo_ttft_ms is not None or self.slo_itl_ms is not None


@dataclass(frozen=True)
class NodeFigure:
    """One node as the planner sees it at one decision."""

    address: str
    role: str  # prefill | decode
    switchable: bool  # started with --role auto and announced in a registry (the fleet can move it)
    outstanding: int  # requests open on it (the proxy's in flight, or the node's running + waiting)
    ttft_p90_ms: float | None = None  # None: nothing measured in the window
    itl_p90_ms: float | None = None


@dataclass(frozen=True)
class Switch:
    address: str
    from_role: str
    to_role: str


@dataclass(frozen=True)
class Decision:
    at: float  # the `now` it was made at
    action: str  # "switch" | "hold"
    reason: str
    current: dict[str, int]
    targets: dict[str, int]  # the counts once `switches` are done
    desired: dict[str, int]  # what an autoscaler should run
    pressure: dict[str, float]  # per role, latency / SLO (0: nothing measured)
    streak: int  # consecutive decisions with this want
    switch: Switch | None = None  # the first of `switches` (None: a hold)
    switches: tuple[Switch, ...] = ()  # every node this decision moves

    def line(self) -> str:
        """The decision as one log line: what, why, and the figures behind it."""
        move = ", ".join(f"{m.address} {m.from_role} -> {m.to_role}" for m in self.switches) or "none"
        return (f"planner: {self.action} ({self.reason}); switch {move}; prefill {self.current[PREFILL]} -> "
                f"{self.targets[PREFILL]} (pressure {self.pressure[PREFILL]:.2f}, desired {self.desired[PREFILL]}), "
                f"decode {self.current[DECODE]} -> {self.targets[DECODE]} (pressure {self.pressure[DECODE]:.2f}, "
                f"desired {self.desired[DECODE]}); streak {self.streak}")

    def to_json(self) -> dict[str, object]:
        out = asdict(self)
        out["pressure"] = {r: round(p, 4) for r, p in self.pressure.items()}
        return out


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def pressure(figures: list[NodeFigure], config: PlannerConfig) -> dict[str, float]:
    """Each role's mean latency p90 over its SLO; 0 for a role with no SLO or nothing measured."""
    ttft = _mean([f.ttft_p90_ms for f in figures if f.role == PREFILL and f.ttft_p90_ms is not None])
    itl = _mean([f.itl_p90_ms for f in figures if f.role == DECODE and f.itl_p90_ms is not None])
    return {PREFILL: ttft / config.slo_ttft_ms if ttft is not None and config.slo_ttft_ms else 0.0,
            DECODE: itl / config.slo_itl_ms if itl is not None and config.slo_itl_ms else 0.0}


def want(p: dict[str, float], band: float) -> tuple[str | None, str]:
    """(the role that should gain a node or None, why)."""
    hot = {r for r in ROLES if p[r] > 1.0}
    if hot == {PREFILL}:
        return PREFILL, "prefill past its TTFT SLO, decode within its ITL SLO"
    if hot == {DECODE}:
        return DECODE, "decode past its ITL SLO, prefill within its TTFT SLO"
    if hot:
        for role, other in ((PREFILL, DECODE), (DECODE, PREFILL)):
            if p[role] > band * p[other]:
                return role, f"both past their SLOs, {role} over {band:g}x worse"
        return None, "both past their SLOs, within the band of each other"
    return None, "both within their SLOs"


@dataclass
class Planner:
    config: PlannerConfig
    decisions: deque[Decision] = field(default_factory=deque)  # the last `config.history`
    _want: str | None = None
    _streak: int = 0
    _last_switch: float = -math.inf

    def decide(self, figures: list[NodeFigure], now: float) -> Decision:
        """One decision from the fleet's figures at `now` (any monotonic clock, seconds)."""
        cfg = self.config
        current = {r: sum(f.role == r for f in figures) for r in ROLES}
        p = pressure(figures, cfg)
        desired = {r: min(cfg.max_desired, max(1, math.ceil(current[r] * p[r])) if p[r] > 0 else max(1, current[r]))
                   for r in ROLES}
        role, why = want(p, cfg.band)
        self._streak = self._streak + 1 if role is not None and role == self._want else int(role is not None)
        self._want = role
        action, moves, reason = "hold", [], why
        if role is not None:
            other = DECODE if role == PREFILL else PREFILL
            movable = sorted((f for f in figures if f.role == other and f.switchable),
                             key=lambda f: (f.outstanding, f.address))  # the least to drain first
            if self._streak < cfg.hysteresis:
                reason = f"{why}; {self._streak} of {cfg.hysteresis} decisions"
            elif now - self._last_switch < cfg.cooldown_s:
                reason = f"{why}; cooling down {cfg.cooldown_s - (now - self._last_switch):.1f} s more"
            elif current[other] <= 1:
                reason = f"{why}; the last {other} node never moves"
            elif not movable:
                reason = f"{why}; no {other} node can switch (none started with --role auto)"
            else:
                # what the role lacks of its desired count, within the step and never its other role's last node
                step = max(1, math.floor(cfg.max_step * len(figures)))
                k = min(step, max(1, desired[role] - current[role]), len(movable), current[other] - 1)
                moves = [Switch(f.address, other, role) for f in movable[:k]]
                action, reason = "switch", why
                self._last_switch, self._streak = now, 0
        targets = dict(current)
        for move in moves:
            targets[move.from_role] -= 1
            targets[move.to_role] += 1
        decision = Decision(now, action, reason, current, targets, desired, p, self._streak,
                            moves[0] if moves else None, tuple(moves))
        self.decisions.append(decision)
        while len(self.decisions) > cfg.history:
            self.decisions.popleft()
        return decision
