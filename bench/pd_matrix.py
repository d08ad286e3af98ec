"""`make bench-pd`: a chat workload on the real model against pd-serve, P/D with the file store and P/D with redis.

    python -m pdserve.bench.pd_matrix [--quick] [--setups pd-serve,pd-file,pd-redis] [--output-dir DIR]
                              [--model DIR|smollm2|bench|tiny] [--workload chat|multi-round-qa]
                              [pd-bench options ...]

The default is SmolLM2-135M-Instruct (made once by pd-make-model's preset) answering `pd-bench chat`:
conversations of real text with one shared system prompt and histories growing from user to user
(bench/chat.py, the texts benchmarks/compare_vllm.py's chat workload uses), so the prefill node's saves
and the decode node's loads carry real shared prefixes. `--workload multi-round-qa` runs LMCache's
synthetic multi-round QA instead. Each setup is started on this host (deploy/processes.py),
benchmarked with pd-bench (the nodes' /metrics scraped for KV counters) and stopped before the next
starts, so they never share the CPU or a cache. Then `pd-bench compare` writes the table
(compare.md) and the plots (compare-*.png) into the output folder, beside each run's own
JSON, table and plots and the servers' logs. Options it does not know go to pd-bench, e.g.
`--users 16 --qps 1 --slo-ttft 2s`.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

from pdserve.bench import cli
from pdserve.deploy.processes import HOST, Child, ClusterSpec, LocalCluster, free_port, python_module

SETUPS = ("pd-serve", "pd-file", "pd-redis")
# Workload sizes (requests, tokens) per workload: the full run, and --quick (a smoke test of the pipeline).
SIZES = {
    "chat": {"full": ["--num-requests", "32", "--answer-len", "128"],
             "quick": ["--num-requests", "4", "--answer-len", "8"]},
    "multi-round-qa": {"full": ["--users", "8", "--rounds", "5", "--system-prompt-len", "1000", "--user-info-len",
                                "500", "--question-len", "30", "--answer-len", "64"],
                       "quick": ["--users", "2", "--rounds", "2", "--system-prompt-len", "128", "--user-info-len",
                                 "64", "--question-len", "16", "--answer-len", "8"]},
}
DEFAULT_BENCH_ARGS = ["--ignore-eos", "--warmup", "2", "--slo-ttft", "2s", "--slo-itl", "200ms"]




def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def pd_serve(model: str, log_dir: Path, node_args: list[str], timeout_s: float) -> Iterator[tuple[str, list[str]]]:
    """A monolithic pd-serve; yields (base URL, its /metrics URL)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    child = Child("pd-serve", python_module("pdserve.serving.server", "--model", model, "--host", HOST, "--port", str(port),
                                            *node_args), log_dir)
    url = f"http://{HOST}:{port}"
    child.start()
    try:
        deadline = time.monotonic() + timeout_s
        while not _http_ok(url + "/health"):
            if not child.alive:
                raise RuntimeError(f"pd-serve exited with {child.proc.returncode}:\n{child.tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"pd-serve not ready after {timeout_s:.0f}s:\n{child.tail()}")
            time.sleep(0.2)
        yield url, [url + "/metrics"]
    finally:
        child.stop()


@contextlib.contextmanager
def pd_cluster(store: str, model: str, log_dir: Path, node_args: list[str],
               timeout_s: float) -> Iterator[tuple[str, list[str]]]:
    """One prefill node, one decode node and the proxy over `store`; yields (proxy URL, the nodes' /metrics)."""
    cluster = LocalCluster(ClusterSpec(model=model, log_dir=log_dir, store=store, node_args=node_args))
    cluster.start(timeout_s)
    try:
        yield cluster.url, [f"http://{HOST}:{n.http_port}/metrics" for n in cluster.prefill + cluster.decode]
    finally:
        cluster.stop()


def start_setup(name: str, model: str, log_dir: Path, node_args: list[str], timeout_s: float):
    if name == "pd-serve":
        return pd_serve(model, log_dir, node_args, timeout_s)
    return pd_cluster(name.removeprefix("pd-"), model, log_dir, node_args, timeout_s)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.pd_matrix", description=__doc__.splitlines()[0],
                                epilog="Other options are passed to pd-bench multi-round-qa.")
    p.add_argument("--quick", action="store_true", help="tiny workload: checks the pipeline end to end")
    p.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated subset of {','.join(SETUPS)}")
    p.add_argument("--model", default="smollm2",
                   help="model directory, or a preset made on first use (default smollm2, the real model)")
    p.add_argument("--workload", choices=tuple(SIZES), default="chat",
                   help="chat (real text, default) or multi-round-qa (LMCache's, synthetic text)")
    p.add_argument("--output-dir", type=Path, default=None,
                   help="results folder (default bench-results/pd-<UTC time>)")
    p.add_argument("--node-args", default="", help="extra engine options for every server, one string")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for a setup to be healthy")
    return p


def main(argv: list[str] | None = None) -> int:
    args, bench_args = build_parser().parse_known_args(argv)
    setups = [s for s in args.setups.split(",") if s]
    unknown = [s for s in setups if s not in SETUPS]
    if unknown or not setups:
        print(f"bench.pd_matrix: error: unknown setup {unknown}; choose from {','.join(SETUPS)}", file=sys.stderr)
        return 2
    from pdserve.deploy.local_cluster import resolve_model

    args.model = resolve_model(args.model)[0]
    out = args.output_dir or Path("bench-results") / datetime.datetime.now(datetime.timezone.utc).strftime(
        "pd-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    workload = SIZES[args.workload]["quick" if args.quick else "full"]
    failed = []
    started = time.monotonic()
    for name in setups:
        log_dir = out / "logs" / name
        print(f"\n=== {name}: starting (logs in {log_dir})", flush=True)
        t0 = time.monotonic()
        with start_setup(name, args.model, log_dir, args.node_args.split(), args.timeout) as (url, metrics):
            print(f"=== {name}: ready in {time.monotonic() - t0:.0f}s at {url}; running {args.workload}", flush=True)
            argv = [args.workload, *workload, *DEFAULT_BENCH_ARGS, *bench_args, "--base-url", url,
                    "--tokenizer", args.model, "--label", name, "--output-dir", str(out)]
            for m in metrics:
                argv += ["--metrics-url", m]
            if cli.main(argv) != 0:
                failed.append(name)
    results = [out / f"{name}.json" for name in setups if (out / f"{name}.json").exists()]
    if results:
        print("\n=== comparison", flush=True)
        cli.main(["compare", *map(str, results), "-o", str(out)])
    print(f"\nbench-pd: {len(setups)} setups in {time.monotonic() - started:.0f}s; results in {out}"
          + (f"; requests failed in {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed or len(results) < len(setups) else 0


if __name__ == "__main__":
    sys.exit(main())
