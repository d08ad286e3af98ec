"""The planner: how many nodes each role should have, and which `--role auto` node to move next.

Pure logic, no I/O: `Planner.decide(figures, now)` reads one `NodeFigure` per node (its role, whether it
can switch, its outstanding requests, its TTFT and ITL p90 over the last window) against the SLOs, and
returns a `Decision`. The proxy's driver (proxy/planner_loop.py) feeds it from what it samples and carries
out the switch; a simulator (benchmarks/fleet_sim.py) can feed it synthetic figures and a synthetic clock.

A role's *pressure* is its latency over its SLO: prefill's mean TTFT p90 / `slo_ttft_ms`, decode's mean
ITL p90 / `slo_itl_ms` (over the nodes that measured any; none measured: 0, idle); its *load* is its nodes'
mean outstanding requests (the queue the latency has not shown yet: a TTFT is measured when it ends). Each
is compared with the previous decision's: the trend. Two rules want a node moved towards a role:
  breach  it is past its SLO while the other is within its own, or, both past, it is more than `band` times
          worse;
  lead    it is at `lead` of its SLO or more and rising (pressure or load up) while the other is at `slack` or
          less and would stay below `lead` with one node fewer: nodes move before the SLO breaks.
A decision moves what the role lacks to bring its pressure down to `lead` (current × pressure / lead), at most
`max_step` of the fleet (at least one node), and no more than keeps the donor within its SLO (a breach) or below
`lead` (a lead), its pressure taken to grow as its nodes shrink.
Against flapping and overshoot (a queue keeps the latency up after the nodes that will drain it have arrived):
the same want must hold for `hysteresis` consecutive decisions; a switch is followed by `cooldown_s` without
another; no switch while the last one's nodes have not shown up in their new role, nor within a window of their
arrival unless the role's pressure and open requests still rise (their effect is not in the p90s yet); none
towards a role past its SLO whose open requests fall, or whose pressure falls while its load does not rise
(recovering); the last node of a role never moves. The dead band between `slack` and `lead` keeps a move from
being undone while the traffic keeps its shape: the donor had slack, the receiver was near its SLO, and one node
changes either's pressure by a fraction, not across the band.

`desired` is what a Kubernetes autoscaler should run per role (HPA's rule, current × pressure, at least
one; a role without figures keeps its count): the `pdserve_planner_desired_replicas` gauge.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass, field

PREFILL, DECODE = "prefill", "decode"
ROLES = (PREFILL, DECODE)
_SLO = {PREFILL: "TTFT", DECODE: "ITL"}


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
    lead: float = 0.8  # a role this near its SLO and rising gains a node before the breach (0: breaches only)
    slack: float = 0.5  # ... from a role at most this near its own
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
    load: dict[str, float] = field(default_factory=dict)  # per role, mean outstanding requests per node
    trend: dict[str, float] = field(default_factory=dict)  # per role, pressure's change since the last decision
    landing: int = 0  # nodes of earlier switches not yet seen in their new role

    def line(self) -> str:
        """The decision as one log line: what, why, and the figures behind it (the reason has no figures, so a hold
        that repeats it is seen as a repeat: proxy/planner_loop.py logs those at DEBUG)."""
        move = ", ".join(f"{m.address} {m.from_role} -> {m.to_role}" for m in self.switches) or "none"
        roles = ", ".join(f"{r} {self.current[r]} -> {self.targets[r]} (pressure {self.pressure[r]:.2f} "
                          f"{self.trend.get(r, 0.0):+.2f}, {self.load.get(r, 0.0):.1f} open per node, "
                          f"desired {self.desired[r]})" for r in ROLES)
        return f"planner: {self.action} ({self.reason}); switch {move}; {roles}; streak {self.streak}; " \
               f"landing {self.landing}"

    def to_json(self) -> dict[str, object]:
        out = asdict(self)
        for key in ("pressure", "load", "trend"):
            out[key] = {r: round(v, 4) for r, v in getattr(self, key).items()}
        return out


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def pressure(figures: list[NodeFigure], config: PlannerConfig) -> dict[str, float]:
    """Each role's mean latency p90 over its SLO; 0 for a role with no SLO or nothing measured."""
    ttft = _mean([f.ttft_p90_ms for f in figures if f.role == PREFILL and f.ttft_p90_ms is not None])
    itl = _mean([f.itl_p90_ms for f in figures if f.role == DECODE and f.itl_p90_ms is not None])
    return {PREFILL: ttft / config.slo_ttft_ms if ttft is not None and config.slo_ttft_ms else 0.0,
            DECODE: itl / config.slo_itl_ms if itl is not None and config.slo_itl_ms else 0.0}


def load(figures: list[NodeFigure]) -> dict[str, float]:
    """Each role's mean outstanding requests per node (0 without nodes)."""
    return {r: _mean([float(f.outstanding) for f in figures if f.role == r]) or 0.0 for r in ROLES}


def _other(role: str) -> str:
    return DECODE if role == PREFILL else PREFILL


def want(p: dict[str, float], config: PlannerConfig, dp: dict[str, float] | None = None,
         dload: dict[str, float] | None = None) -> tuple[str | None, str, bool]:
    """(the role that should gain a node or None, why, whether it is a lead: no SLO broken yet). `dp`, `dload`:
    pressure's and load's change since the previous decision (None: no trend yet, so no lead)."""
    hot = {r for r in ROLES if p[r] > 1.0}
    if len(hot) == 1:
        (role,) = hot
        other = _other(role)
        return role, f"{role} past its {_SLO[role]} SLO, {other} within its {_SLO[other]} SLO", False
    if hot:
        for role, other in ((PREFILL, DECODE), (DECODE, PREFILL)):
            if p[role] > config.band * p[other]:
                return role, f"both past their SLOs, {role} over {config.band:g}x worse", False
        return None, "both past their SLOs, within the band of each other", False
    if config.lead > 0 and dp is not None and dload is not None:
        for role in ROLES:
            other = _other(role)
            rising = dp[role] > 0 or dload[role] > 0
            if p[role] >= config.lead and rising and p[other] <= config.slack:
                return role, (f"{role} nearing its {_SLO[role]} SLO and rising, {other} has slack (at most "
                              f"{config.slack:g} of its SLO)"), True
    return None, "both within their SLOs", False


def _recovering(role: str, dp: dict[str, float], dload: dict[str, float], dopen: dict[str, float]) -> bool:
    """The role's queue drains with the nodes it has: its open requests in all fell (the latency follows later: a
    request that waited is measured when it ends), or its pressure fell while its load per node did not rise."""
    return dopen[role] < 0 or (dp[role] < 0 and dload[role] <= 0)


@dataclass
class Planner:
    config: PlannerConfig
    decisions: deque[Decision] = field(default_factory=deque)  # the last `config.history`
    _want: str | None = None
    _streak: int = 0
    _last_switch: float = -math.inf
    _landing: dict[str, float] = field(default_factory=dict)  # switched node -> when: not yet seen again
    _landed_at: float = -math.inf  # when a switched node was last seen in its new role
    _previous: tuple[dict[str, float], dict[str, float], dict[str, float]] | None = None  # (pressure, load, open)

    def _landed(self, figures: list[NodeFigure], now: float) -> int:
        """Forget the switched nodes seen again (in either role: a failed switch brings one back in its old role)
        or older than a drain's bound; what is left is still on its way."""
        seen = {f.address for f in figures}
        limit = self.config.drain_timeout_s + self.config.cooldown_s
        if any(a in seen for a in self._landing):
            self._landed_at = now
        self._landing = {a: t for a, t in self._landing.items() if a not in seen and now - t <= limit}
        return len(self._landing)

    def decide(self, figures: list[NodeFigure], now: float) -> Decision:
        """One decision from the fleet's figures at `now` (any monotonic clock, seconds)."""
        cfg = self.config
        current = {r: sum(f.role == r for f in figures) for r in ROLES}
        p, q = pressure(figures, cfg), load(figures)
        total = {r: q[r] * current[r] for r in ROLES}  # open requests in all
        dp = dq = dn = None  # the trends: each figure's change since the last decision (none at the first)
        if self._previous is not None:
            dp, dq, dn = ({r: cur[r] - prev[r] for r in ROLES} for cur, prev in zip((p, q, total), self._previous))
        self._previous = (p, q, total)
        landing = self._landed(figures, now)
        desired = {r: min(cfg.max_desired, max(1, math.ceil(current[r] * p[r])) if p[r] > 0 else max(1, current[r]))
                   for r in ROLES}
        role, why, lead = want(p, cfg, dp, dq)
        self._streak = self._streak + 1 if role is not None and role == self._want else int(role is not None)
        self._want = role
        action, moves, reason = "hold", [], why
        if role is not None:
            other = _other(role)
            movable = sorted((f for f in figures if f.role == other and f.switchable),
                             key=lambda f: (f.outstanding, f.address))  # the least to drain first

            def after(k: int) -> float:  # the donor's pressure with k nodes fewer, its load spread over the rest
                return p[other] * current[other] / max(1, current[other] - k)

            if self._streak < cfg.hysteresis:
                reason = f"{why}; {self._streak} of {cfg.hysteresis} decisions"
            elif landing:
                reason = f"{why}; {landing} switched node(s) not yet in their new role"
            elif now - self._last_switch < cfg.cooldown_s:
                reason = f"{why}; cooling down {cfg.cooldown_s - (now - self._last_switch):.1f} s more"
            elif dp is not None and dn is not None and now - self._landed_at < cfg.window_s \
                    and not (dp[role] > 0 and dn[role] >= 0):  # their effect shows in the p90s a window later
                reason = f"{why}; switched nodes arrived within the window: their effect is not in the p90s yet"
            elif not lead and dp is not None and dq is not None and dn is not None and _recovering(role, dp, dq, dn):
                reason = f"{why}; recovering (its queue draining): another node now would overshoot"
            elif current[other] <= 1:
                reason = f"{why}; the last {other} node never moves"
            elif not movable:
                reason = f"{why}; no {other} node can switch (none started with --role auto)"
            elif lead and after(1) >= cfg.lead:
                reason = f"{why}; {other} would reach the lead ({cfg.lead:g}) with one node fewer"
            else:
                # what the role lacks to bring its pressure down to the lead (not just to 1.0: a decode node's ITL
                # is its batch's step time, so every stream fails the SLO at once past 1.0, and a queue's latency
                # keeps rising until it drains), within the step; no more than keeps the donor below the lead
                # (a lead move) or within its SLO (a breach)
                step = max(1, math.floor(cfg.max_step * len(figures)))
                k = min(step, max(1, math.ceil(current[role] * p[role] / (cfg.lead or 1.0)) - current[role]))
                limit = cfg.lead if lead else 1.0
                while k > 1 and p[other] <= limit < after(k):
                    k -= 1
                k = min(k, len(movable), current[other] - 1)
                moves = [Switch(f.address, other, role) for f in movable[:k]]
                action, reason = "switch", why
                self._last_switch, self._streak = now, 0
                self._landing.update({m.address: now for m in moves})
        targets = dict(current)
        for move in moves:
            targets[move.from_role] -= 1
            targets[move.to_role] += 1
        decision = Decision(now, action, reason, current, targets, desired, p, self._streak,
                            moves[0] if moves else None, tuple(moves), q, dp or {r: 0.0 for r in ROLES}, landing)
        self.decisions.append(decision)
        while len(self.decisions) > cfg.history:
            self.decisions.popleft()
        return decision
