"""`pd-proxy`: the OpenAI-compatible entry point of a P/D cluster."""
from __future__ import annotations

import argparse
import sys

from pdserve.common import eventloop
from pdserve.proxy.admission import AdmissionConfig
from pdserve.proxy.app import Proxy, ProxyConfig
from pdserve.proxy.decode_stream import Deadlines
from pdserve.proxy.fleet_sources import DNS_POLL_S, REGISTRY_POLL_S
from pdserve.proxy.planner import PlannerConfig
from pdserve.proxy.router import POLICIES
from pdserve.serving.auth import add_proxy_security_args, proxy_security
from pdserve.serving.cli import (LOG_LEVELS, ArgumentParser, add_log_file, add_response_args, config_default,
                                setup_logging)
from pdserve.serving.errors import StartupError
from pdserve.serving.http import listen_socket, serve_app
from pdserve.serving.limits import HttpTimeouts, add_http_timeout_args


def _addresses(text: str) -> list[str]:
    out = [a.strip() for a in text.split(",") if a.strip()]
    for a in out:
        host, sep, port = a.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {a!r}")
    if not out:
        raise argparse.ArgumentTypeError("expected at least one HOST:PORT")
    return out


def _name_port(text: str) -> str:
    name, sep, port = text.rpartition(":")
    if not sep or not name or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected NAME:PORT, got {text!r}")
    return text


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="pd-proxy", description="Routing proxy: OpenAI API in front of prefill and decode "
                       "nodes (gRPC)")
    p.add_argument("--prefill", type=_addresses, default=[], metavar="HOST:PORT[,...]",
                   help="gRPC addresses of the prefill nodes (none from any source: decode nodes prefill locally)")
    p.add_argument("--decode", type=_addresses, default=[], metavar="HOST:PORT[,...]",
                   help="gRPC addresses of the decode nodes (this, --decode-dns or --fleet-registry is required)")
    fleet = p.add_argument_group("fleet", "nodes that come and go (docs/operations.md, \"A fleet\")")
    fleet.add_argument("--fleet-registry", default=None, metavar="redis://HOST:PORT/DB",
                       help=f"also route to the nodes announced in this Redis registry (their --fleet-registry), "
                            f"read every {REGISTRY_POLL_S:g} s")
    fleet.add_argument("--prefill-dns", type=_name_port, default=None, metavar="NAME:PORT",
                       help=f"also route to a prefill node at each A record of NAME (a Kubernetes headless Service), "
                            f"resolved every {DNS_POLL_S:g} s")
    fleet.add_argument("--decode-dns", type=_name_port, default=None, metavar="NAME:PORT",
                       help="the same for decode nodes")
    fleet.add_argument("--kv-events", default=None, metavar="redis://HOST:PORT/DB",
                       help="with --policy kv-aware: route from an index of the nodes' KV events (their --kv-events, "
                            "the same URL; vLLM's --kv-events-config) instead of asking every node's Lookup per request")
    # Defaults the proxy's dataclasses own (ProxyConfig, Deadlines) are read from them; the help quotes each.
    host, port, level = "127.0.0.1", 8000, "INFO"
    p.add_argument("--host", default=host, help=f"address to listen on (default {host})")
    p.add_argument("--port", type=int, default=port, help=f"HTTP port (default {port})")
    policy = config_default(ProxyConfig, "policy")
    p.add_argument("--policy", choices=POLICIES, default=policy, help=f"routing policy (default {policy})")
    threshold = config_default(ProxyConfig, "local_prefill_threshold")
    p.add_argument("--local-prefill-threshold", type=int, default=threshold, metavar="N",
                   help=f"prompts shorter than N tokens skip the prefill node (default {threshold}: never)")
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/*")
    interval = config_default(ProxyConfig, "health_interval_s")
    p.add_argument("--health-interval", type=float, default=interval,
                   help=f"seconds between node health checks (default {interval:g})")
    d = Deadlines()
    p.add_argument("--connect-timeout", type=float, default=d.connect_s, metavar="S",
                   help=f"seconds to connect to a node before trying the next (default {d.connect_s:g})")
    p.add_argument("--first-token-timeout", type=float, default=d.first_token_s, metavar="S",
                   help=f"seconds from a decode call to its first token (default {d.first_token_s:g})")
    p.add_argument("--token-timeout", type=float, default=d.token_s, metavar="S",
                   help=f"seconds between two tokens of a stream (default {d.token_s:g})")
    p.add_argument("--stall-timeout", type=float, default=d.stall_s, metavar="S",
                   help=f"seconds a decode stream may stay silent, heartbeats included, before its node counts "
                        f"as frozen (default {d.stall_s:g}; nodes send a heartbeat every second)")
    p.add_argument("--decode-recovery-timeout", type=float, default=d.recovery_s, metavar="S",
                   help="when no other decode node can take a stream (one decode node, or every other out of "
                        "rotation): seconds of silence a stream waits for its silent or failed decode node to answer "
                        "again or return to rotation, resuming there, before it fails (default "
                        f"{d.recovery_s:g}; at least --stall-timeout)")
    prefill_s = config_default(ProxyConfig, "prefill_timeout_s")
    p.add_argument("--prefill-timeout", type=float, default=prefill_s, metavar="S",
                   help=f"seconds one Prefill call may take (default {prefill_s:g})")
    _add_planner_args(p)
    add_http_timeout_args(p)
    add_proxy_security_args(p)
    add_response_args(p)
    p.add_argument("--log-file", default=None, help="also write the log here")
    p.add_argument("--log-level", default=level, choices=LOG_LEVELS, help=f"log level (default {level})")
    return p


def _add_planner_args(p: ArgumentParser) -> None:
    g = p.add_argument_group("planner and admission", "SLOs, role switching, the admission queue "
                             "(docs/operations.md, \"Planner\")")
    g.add_argument("--slo-ttft-ms", type=float, default=None, metavar="MS",
                   help="time-to-first-token target (p90, as the prefill nodes measure it): with --slo-itl-ms, turns "
                        "the planner on; it moves --role auto nodes between prefill and decode")
    g.add_argument("--slo-itl-ms", type=float, default=None, metavar="MS",
                   help="inter-token latency target (p90, as the decode nodes measure it); also turns admission "
                        "control on")
    c = PlannerConfig()
    g.add_argument("--planner-interval", type=float, default=c.interval_s, metavar="S",
                   help=f"seconds between two planner decisions (default {c.interval_s:g})")
    g.add_argument("--planner-window", type=float, default=c.window_s, metavar="S",
                   help=f"seconds of node samples the latency p90s cover (default {c.window_s:g})")
    g.add_argument("--planner-hysteresis", type=int, default=c.hysteresis, metavar="N",
                   help=f"consecutive decisions a role must be out of band before a node moves (default "
                        f"{c.hysteresis})")
    g.add_argument("--planner-cooldown", type=float, default=c.cooldown_s, metavar="S",
                   help=f"seconds after a role switch before the next (default {c.cooldown_s:g})")
    g.add_argument("--planner-max-step", type=float, default=c.max_step, metavar="SHARE",
                   help=f"share of the fleet one decision may move, at least one node; it moves what the role lacks "
                        f"of its desired count (default {c.max_step:g}; 0: one node per decision)")
    g.add_argument("--planner-lead", type=float, default=c.lead, metavar="SHARE",
                   help=f"a role at this share of its SLO and rising gains a node before the SLO breaks, from one at "
                        f"most --planner-slack of its own (default {c.lead:g}; 0: only once an SLO is broken)")
    g.add_argument("--planner-slack", type=float, default=c.slack, metavar="SHARE",
                   help=f"the share of its SLO a role may be at and still give a node on a lead (default {c.slack:g})")
    g.add_argument("--role-drain-timeout", type=float, default=c.drain_timeout_s, metavar="S",
                   help=f"seconds a switching node may take to finish its old role's calls (default "
                        f"{c.drain_timeout_s:g}; past it the role switches and they still finish)")
    g.add_argument("--admission-control", action=argparse.BooleanOptionalAction, default=None,
                   help="queue new requests while every decode node is past --slo-itl-ms, 429 beyond the queue "
                        "(default: on with --slo-itl-ms, off without: there is no SLO to hold)")
    a = AdmissionConfig()
    g.add_argument("--max-queued-requests", type=int, default=a.max_queued, metavar="N",
                   help=f"requests the admission queue holds (default {a.max_queued}); one more is answered 429")
    g.add_argument("--max-queue-wait", type=float, default=a.max_wait_s, metavar="S",
                   help=f"seconds a queued request waits before its 429 (default {a.max_wait_s:g}; its Retry-After)")


def _planner_configs(args: argparse.Namespace) -> tuple[PlannerConfig, AdmissionConfig | None]:
    planner = PlannerConfig(args.slo_ttft_ms, args.slo_itl_ms, args.planner_interval, args.planner_window,
                            args.planner_hysteresis, args.planner_cooldown, args.planner_max_step,
                            lead=args.planner_lead, slack=args.planner_slack, drain_timeout_s=args.role_drain_timeout)
    on = args.admission_control if args.admission_control is not None else args.slo_itl_ms is not None
    if on and args.slo_itl_ms is None:
        raise ValueError("--admission-control needs --slo-itl-ms: the queue holds requests while decode is past it")
    return planner, AdmissionConfig(args.max_queued_requests, args.max_queue_wait) if on else None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not (args.decode or args.decode_dns or args.fleet_registry):
        parser.error("no decode nodes: give --decode, --decode-dns or --fleet-registry")
    setup_logging(args.log_level)
    if args.log_file:
        try:
            add_log_file(args.log_file)
        except OSError as e:
            print(f"pd-proxy: error: cannot write log file {args.log_file}: {e.strerror or e}", file=sys.stderr)
            return 1
    security = proxy_security(args)
    try:
        security.check(server=False)
    except ValueError as e:
        print(f"pd-proxy: error: {e}", file=sys.stderr)
        return 1
    try:
        deadlines = Deadlines(args.connect_timeout, args.first_token_timeout, args.token_timeout, args.stall_timeout,
                              args.decode_recovery_timeout)
        timeouts = HttpTimeouts.from_args(args)
        planner, admission = _planner_configs(args)
    except ValueError as e:
        print(f"pd-proxy: error: {e}", file=sys.stderr)
        return 1
    config = ProxyConfig(prefill=args.prefill, decode=args.decode, fleet_registry=args.fleet_registry,
                         prefill_dns=args.prefill_dns, decode_dns=args.decode_dns, policy=args.policy,
                         local_prefill_threshold=args.local_prefill_threshold, api_key=args.api_key,
                         health_interval_s=args.health_interval, grpc_security=security,
                         deadlines=deadlines, prefill_timeout_s=args.prefill_timeout,
                         return_tokens_as_token_ids=args.return_tokens_as_token_ids, kv_events=args.kv_events,
                         planner=planner, admission=admission)
    try:
        eventloop.loop_kind()
    except ValueError as e:
        print(f"pd-proxy: error: {e}", file=sys.stderr)
        return 1
    try:
        sock = listen_socket(args.host, args.port)
    except StartupError as e:
        print(f"pd-proxy: error: {e}", file=sys.stderr)
        return 1
    proxy = Proxy(config)
    eventloop.run(serve_app(proxy.app(), sock, "pd-proxy", lambda: f"(policy {config.policy}, {_fleet_line(proxy)})",
                            timeouts=timeouts))
    return 0


def _fleet_line(proxy: Proxy) -> str:
    """The nodes known at start and where more come from, for the ready line."""
    prefill, decode = (",".join(n.address for n in r.nodes) for r in (proxy.prefill, proxy.decode))
    dynamic = [f"{s.kind} {s.where}" for s in proxy.fleet.sources if s.interval_s is not None]
    return (f"prefill {prefill or '- (decode nodes prefill every prompt)'}, decode {decode or '-'}"
            + (f", fleet from {'; '.join(dynamic)}" if dynamic else ""))


if __name__ == "__main__":
    sys.exit(main())
