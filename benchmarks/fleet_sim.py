"""Scale by simulation of the real code (issue 37, item 5): pd-proxy's Router and KVIndex driving 8..1024 simulated nodes.

benchmarks/fleet_model.py holds the model (which objects are real, how the nodes take time); fleet_traces.py the
traces. Two experiments, each on traces generated here (seeded):
  routing   per fleet size N (N/2 prefill + N/2 decode), a multi-round chat trace (Poisson) and a long-document
            QA trace (bursty), at half the prefill nodes' no-cache capacity: the real `Router.rank()` over the
            index, timed per request (perf_counter_ns around the call; p50/p99 µs), the index's entries and bytes
            (a getsizeof walk) at the end, and the prompt tokens served from the prefill node's cache, against the
            same trace routed by the per-request Lookup policy (fresh, perfect answers from every node's cache).
  goodput   the shifting trace (long prompts/short answers, then short prompts/long answers) at N nodes for every
            static P:D split (every one up to 16 nodes, 15 evenly spaced above), and with proxy/planner.py's
            Planner.decide() every interval (its defaults, and its previous ones for comparison: 10 s interval,
            60 s window, hysteresis 3, 60 s cooldown, one switch per decision) moving nodes from 1:1: requests/s
            meeting the SLOs (TTFT <= --slo-ttft, time per output token <= --slo-tpot) over the trace's length, at
            each of --shift-loads, for each of --goodput-seeds (the trace drawn again); with the planner's switches
            and reversals (a switch the other way from the one before: one per shift is the least there can be).
Writes a markdown table (stdout and bench-results/fleet_sim.md), the figures as JSON and a plot (--plot, PNG).
Ratios against baselines in the same run; nothing here asserts a time.

    .venv/bin/python benchmarks/fleet_sim.py [--quick] [--sizes 8,32,128,512,1024] [--profile FILE] [--plot PATH]
                                     [--goodput-seeds 0,1,2]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from pdserve.bench.stats import percentile

import fleet_traces
from fleet_model import Profile, Result, Simulator, index_bytes
from machine import describe

OUT = Path("bench-results")
_REPLAY = 2000  # requests whose ranking is timed again at the end, best of 3 each (what the code costs, not the host)


def _rate_for(profile: Profile, trace: list[fleet_traces.TraceRequest], nodes: int, load: float) -> float:
    """Requests/s that keep `nodes` prefill nodes `load` busy when nothing is cached."""
    mean_s = statistics.fmean(profile.prefill_s(r.prompt_len, 0) for r in trace)
    return load * nodes / mean_s


def _hit_rate(res: Result) -> float:
    return sum(f.cached for f in res.flights) / max(1, sum(f.req.prompt_len for f in res.flights))


def routing(profile: Profile, n: int, shape: str, arrival: str, duration: float, seed: int) -> dict[str, Any]:
    def make(rate: float) -> list[fleet_traces.TraceRequest]:
        if shape == "chat":
            return fleet_traces.chat(arrival, rate, duration, seed)
        return fleet_traces.docqa(arrival, rate, duration, max(4, n // 2), seed)

    trace = make(_rate_for(profile, make(2.0), n // 2, 0.5))
    t0 = time.perf_counter()
    sim = Simulator(profile, n // 2, n - n // 2, "index")
    by_index = sim.run(trace)
    ops = by_index.index.ops / max(1, len(trace))  # type: ignore[union-attr]  (before the replay adds its own)
    replay = [sim.time_rank(r, 3) for r in trace[-_REPLAY:]]
    t1 = time.perf_counter()
    by_lookup = Simulator(profile, n // 2, n - n // 2, "lookup").run(trace)
    t2 = time.perf_counter()
    status = by_index.index.status()  # type: ignore[union-attr]
    ns = by_index.route_ns
    long = [t for t, r in zip(replay, trace[-_REPLAY:]) if r.prompt_len >= 2048]
    return {"nodes": n, "trace": f"{shape}-{arrival}", "requests": len(trace),
            "mean_prompt": statistics.fmean(r.prompt_len for r in trace),
            "route_p50_us": percentile(ns, 50) / 1e3, "route_p99_us": percentile(ns, 99) / 1e3,
            "replay_p50_us": percentile(replay, 50) / 1e3, "replay_p99_us": percentile(replay, 99) / 1e3,
            "replay_p99_us_2k": percentile(long, 99) / 1e3 if long else None,
            "index_ops": ops,
            "index_chunks": status["chunks"], "index_bytes": index_bytes(by_index.index),  # type: ignore[arg-type]
            "hit_index": _hit_rate(by_index), "hit_lookup": _hit_rate(by_lookup),
            "sim_s": {"index": round(t1 - t0, 1), "lookup": round(t2 - t1, 1)}}


def _goodput(res: Result, slo_ttft: float, slo_tpot: float) -> float:
    ok = 0
    for f in res.flights:
        tpot = (f.done_s - f.first_s) / (f.req.output - 1) if f.req.output > 1 else 0.0
        ok += f.first_s - f.req.t <= slo_ttft and tpot <= slo_tpot and f.done_s > 0
    return ok / res.duration


def shift_trace(profile: Profile, n: int, duration: float, seed: int, load: float) -> list[fleet_traces.TraceRequest]:
    """The shifting trace at `n` nodes: each phase at `load` of what the whole fleet could do in that phase's
    bottleneck role (prefill for the long prompts, decode for the long answers, a batch of 32): past 0.5, a 1:1
    fleet is overloaded in both phases."""
    long_s = profile.prefill_s(2048, 0)
    step = profile.step_s(32, 32 * 700)
    short_rate = load * n * 32 / step / 512
    return fleet_traces.shift("poisson", load * n / long_s, short_rate, duration, seed)


class PlannerDriver:
    """proxy/planner.py's `Planner.decide()` as the simulator's tick, as proxy/planner_loop.py drives it: each node's
    figure (its load score, its TTFT / token-gap p90 over the window), then the switch it asks for."""

    def __init__(self, config: Any) -> None:
        from pdserve.proxy.planner import Planner
        self.config, self.planner, self.switches, self.reversals = config, Planner(config), 0, 0
        self._towards: str | None = None  # the role the last switch fed

    def __call__(self, sim: Simulator, now: float) -> None:
        from pdserve.proxy.planner import NodeFigure
        figures, by_address = [], {}
        for node in [*sim.prefill.nodes, *sim.decode.nodes]:
            node.samples = [s for s in node.samples if now - s[0] <= self.config.window_s]  # (a step may end later)
            seen = [v for t, v in node.samples if t <= now]
            p90 = percentile(seen, 90) * 1e3 if seen else None
            prefill = node.role == "prefill"
            figures.append(NodeFigure(node.address, node.role, True, node.load.score, p90 if prefill else None,
                                      None if prefill else p90))
            by_address[node.address] = node
        decision = self.planner.decide(figures, now)
        for move in decision.switches:
            self.switches += 1
            self.reversals += self._towards is not None and move.to_role != self._towards
            self._towards = move.to_role
            sim.move(by_address[move.address])


def planner_configs(slo_ttft: float, slo_tpot: float) -> dict[str, Any]:
    """The planner's defaults, and its previous ones (a node a minute at most: too slow for a shift that needs a
    dozen moves); {} when proxy/planner.py is missing."""
    try:
        from pdserve.proxy.planner import PlannerConfig
    except ImportError:
        return {}
    slos = {"slo_ttft_ms": slo_ttft * 1e3, "slo_itl_ms": slo_tpot * 1e3}
    return {"defaults": PlannerConfig(**slos),
            "previous": PlannerConfig(**slos, interval_s=10.0, window_s=60.0, hysteresis=3, cooldown_s=60.0,
                                      max_step=0.0)}


def goodput(profile: Profile, n: int, duration: float, seed: int, slo_ttft: float, slo_tpot: float,
            load: float) -> dict[str, Any]:
    trace = shift_trace(profile, n, duration, seed, load)
    splits = list(range(1, n)) if n <= 16 else sorted({max(1, round(n * k / 16)) for k in range(1, 16)})
    by_split = {p: _goodput(Simulator(profile, p, n - p, "index").run(trace), slo_ttft, slo_tpot) for p in splits}
    if n // 2 not in by_split:
        by_split[n // 2] = _goodput(Simulator(profile, n // 2, n - n // 2, "index").run(trace), slo_ttft, slo_tpot)
    best = max(by_split, key=by_split.__getitem__)
    planned: dict[str, Any] = {}
    for name, config in planner_configs(slo_ttft, slo_tpot).items():
        driver = PlannerDriver(config)
        res = Simulator(profile, n // 2, n - n // 2, "index", on_tick=driver, tick_s=config.interval_s).run(trace)
        planned[name] = {"goodput": _goodput(res, slo_ttft, slo_tpot), "switches": driver.switches,
                         "reversals": driver.reversals, "prefill_nodes": [(round(t, 1), p) for t, p in res.roles]}
    return {"nodes": n, "load": load, "seed": seed, "requests": len(trace), "offered_rps": len(trace) / duration,
            "by_split": by_split, "one_to_one": by_split[n // 2], "best_split": best, "best": by_split[best], "planner": planned}


def table(rows: list[dict[str, Any]], goods: list[dict[str, Any]], machine: str, profile: Profile) -> str:
    out = [machine, f"profile: {profile.source}", "",
           "| nodes | trace | requests | mean prompt | route p50 / p99 µs in the run | replay p50 / p99 µs | "
           "replay p99 µs, prompts >= 2k | index ops / request | index chunks | index MB | hit: index | hit: lookups "
           "| Δ points |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p2k = f"{r['replay_p99_us_2k']:.0f}" if r["replay_p99_us_2k"] is not None else "-"
        out.append(f"| {r['nodes']} | {r['trace']} | {r['requests']} | {r['mean_prompt']:.0f} | {r['route_p50_us']:.0f}"
                   f" / {r['route_p99_us']:.0f} | {r['replay_p50_us']:.0f} / {r['replay_p99_us']:.0f} | {p2k} | {r['index_ops']:.1f} | {r['index_chunks']} | {r['index_bytes'] / 1e6:.1f}"
                   f" | {100 * r['hit_index']:.1f}% | {100 * r['hit_lookup']:.1f}%"
                   f" | {100 * (r['hit_index'] - r['hit_lookup']):+.1f} |")
    out += ["", "| nodes | load | seed | requests (req/s offered) | goodput 1:1 | best static P:D (hindsight) | best / 1:1 "
                "| planner (config): goodput, switches (reversals) | planner / 1:1 | planner / best |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for g in goods:
        n = g["nodes"]
        head = (f"| {n} | {g['load']:g} | {g.get('seed', 0)} | {g['requests']} ({g['offered_rps']:.1f}) | "
                f"{g['one_to_one']:.2f} req/s | {g['best_split']}:{n - g['best_split']} {g['best']:.2f} req/s | {g['best'] / g['one_to_one']:.2f}x")
        for name, p in g["planner"].items() or [("none: no proxy/planner.py", None)]:
            if p is None:
                out.append(f"{head} | {name} | - | - |")
                continue
            out.append(f"{head} | ({name}) {p['goodput']:.2f} req/s, {p['switches']} ({p.get('reversals', '-')}) | "
                       f"{p['goodput'] / g['one_to_one']:.2f}x | {p['goodput'] / g['best']:.2f}x |")
    return "\n".join(out)


def plot(rows: list[dict[str, Any]], goods: list[dict[str, Any]], path: Path, machine: str) -> None:
    import logging

    import matplotlib
    matplotlib.use("Agg")
    logging.getLogger("matplotlib.font_manager").setLevel(logging.ERROR)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for trace in sorted({r["trace"] for r in rows}):
        rs = [r for r in rows if r["trace"] == trace]
        x = [r["nodes"] for r in rs]
        axes[0].plot(x, [r["route_p50_us"] for r in rs], "o-", label=f"{trace} p50")
        axes[0].plot(x, [r["route_p99_us"] for r in rs], "s--", label=f"{trace} p99")
        axes[0].plot(x, [r["replay_p99_us"] for r in rs], "^:", label=f"{trace} p99, replay best of 3")
        axes[1].plot(x, [100 * r["hit_index"] for r in rs], "o-", label=f"{trace}: index")
        axes[1].plot(x, [100 * r["hit_lookup"] for r in rs], "x:", label=f"{trace}: per-request lookups")
    axes[0].set_yscale("log")
    goods = [g for g in goods if g.get("seed", 0) == goods[0].get("seed", 0)] if goods else []  # one seed's curves
    for ax, title, unit in ((axes[0], "Router.rank() over the KV index", "µs per request"),
                            (axes[1], "prompt tokens from the prefill node's cache", "%")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("simulated nodes")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.legend(fontsize=7)
    for g in goods:
        by = {int(p): v for p, v in g["by_split"].items()}  # (JSON made the keys strings)
        line, = axes[2].plot([p / g["nodes"] for p in sorted(by)], [by[p] / g["nodes"] for p in sorted(by)], "o-",
                             label=f"{g['nodes']} nodes, load {g['load']:g}, static P:D")
        for (name, p), marker in zip(g["planner"].items(), ("D", "*")):  # starting from 1:1
            axes[2].plot([0.5], [p["goodput"] / g["nodes"]], marker, color=line.get_color(), ms=9, mfc="none",
                         label=f"planner ({name}), from 1:1" if g is goods[0] else None)
    axes[2].axvline(0.5, color="grey", lw=0.8)
    axes[2].set_xlabel("prefill share of the fleet (static)")
    axes[2].set_ylabel("goodput per node, req/s")
    axes[2].set_title("shifting trace: goodput under the SLOs")
    axes[2].legend(fontsize=7)
    fig.suptitle(machine, fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="8..128 nodes, goodput at 8, short traces (~10 s)")
    ap.add_argument("--sizes", help="fleet sizes for the routing experiment (default 8,32,128,512,1024)")
    ap.add_argument("--goodput-sizes", help="fleet sizes for the goodput experiment (default 8,32)")
    ap.add_argument("--duration", type=float, help="seconds of simulated trace (default 60, --quick 30)")
    ap.add_argument("--goodput-duration", type=float, help="seconds of the shifting trace (default 600, --quick 240)")
    ap.add_argument("--profile", help="a JSON of fleet_model.Profile's fields (default: docs/benchmarks.md's)")
    ap.add_argument("--shift-loads", default="0.45,0.5,0.6",
                    help="the shifting trace's rates, each a share of the whole fleet's capacity in the busy role")
    ap.add_argument("--slo-ttft", type=float, default=4.0)
    ap.add_argument("--slo-tpot", type=float, default=0.06)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--goodput-seeds", help="seeds of the shifting trace, each a run (default: --seed)")
    ap.add_argument("--plot", default="docs/img/bench-fleet-sim.png")
    ap.add_argument("--from-json", help="redraw the table and the plot from a run's bench-results/fleet_sim.json")
    args = ap.parse_args()
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        print(table(saved["routing"], saved["goodput"], saved["machine"], Profile(**saved["profile"])))
        if args.plot:
            plot(saved["routing"], saved["goodput"], Path(args.plot), saved["machine"])
        return
    machine = describe()
    print(machine, flush=True)
    profile = Profile.load(args.profile)
    default = ("8,32,128", "8") if args.quick else ("8,32,128,512,1024", "8,32")
    sizes = [int(s) for s in (default[0] if args.sizes is None else args.sizes).split(",") if s]
    gsizes = [int(s) for s in (default[1] if args.goodput_sizes is None else args.goodput_sizes).split(",") if s]
    duration = args.duration or (30.0 if args.quick else 60.0)
    rows = []
    for n in sizes:
        for shape, arrival in (("chat", "poisson"), ("docqa", "bursty")):
            rows.append(routing(profile, n, shape, arrival, duration, args.seed))
            print(json.dumps(rows[-1]), flush=True)
    goods = []
    seeds = [int(s) for s in args.goodput_seeds.split(",")] if args.goodput_seeds else [args.seed]
    for n in gsizes:
        for load in [float(x) for x in args.shift_loads.split(",")]:
            for seed in seeds:
                goods.append(goodput(profile, n, args.goodput_duration or (240.0 if args.quick else 600.0), seed,
                                     args.slo_ttft, args.slo_tpot, load))
                print(json.dumps(goods[-1]), flush=True)
    text = table(rows, goods, machine, profile)
    print(text)
    OUT.mkdir(exist_ok=True)
    (OUT / "fleet_sim.md").write_text(text + "\n")
    (OUT / "fleet_sim.json").write_text(json.dumps({"machine": machine, "profile": profile.as_dict(),
                                                    "routing": rows, "goodput": goods}, indent=1))
    if args.plot:
        plot(rows, goods, Path(args.plot), machine)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
