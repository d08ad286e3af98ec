"""`make serve`: one prefill node, one decode node and the proxy on localhost.

    python -m pdserve.deploy.local_cluster [--store file|redis|lmcache] [--port 8000] [--model DIR]

Uses the built-in tiny model unless --model is given, starts redis-server or LMCache's
server itself for those stores, waits until the proxy sees both nodes healthy, prints how
to use the cluster, and stops every child on Ctrl-C or SIGTERM.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from pdserve.deploy.processes import ClusterSpec, LocalCluster
from pdserve.proxy.router import DEFAULT_POLICY, POLICIES


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pdserve.deploy.local_cluster", description=__doc__.split("\n")[0])
    p.add_argument("--store", choices=("file", "redis", "lmcache"), default="file",
                   help="shared KV store (default file: a directory under the log dir)")
    p.add_argument("--redis-maxmemory", default="1gb",
                   help="with --store redis: the redis server's memory bound; least recently used chunks are "
                        "evicted beyond it (default 1gb)")
    p.add_argument("--model", default=None, help="model directory (default: the built-in tiny model)")
    p.add_argument("--port", type=int, default=8000, help="proxy port (default 8000; 0: any free port)")
    p.add_argument("--policy", default=DEFAULT_POLICY, choices=POLICIES)
    p.add_argument("--log-dir", default=None, help="where logs go (default: a new temp directory)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for the cluster to be healthy")
    p.add_argument("--device", default=None, help="engine device of both nodes: auto|cpu|cuda|cuda:N (default auto)")
    return p


class _Stop(Exception):
    pass


def _raise_stop(signum: int, frame: object) -> None:
    raise _Stop()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.model is None:
        from pdserve.engine.builtin_model import default_model_path

        print("preparing the built-in tiny model ...", flush=True)
        args.model = str(default_model_path())
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pdserve-cluster-"))
    cluster = LocalCluster(ClusterSpec(model=args.model, log_dir=log_dir, store=args.store, policy=args.policy,
                                       redis_maxmemory=args.redis_maxmemory, proxy_port=args.port,
                                       node_args=["--device", args.device] if args.device else []))
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    try:
        print(f"starting prefill, decode and proxy (store {cluster.kv_store}); logs in {log_dir}", flush=True)
        cluster.start(args.timeout)
        logs = " ".join(str(n.log_file) for n in cluster.prefill + cluster.decode)
        # `make serve` runs from the venv without activating it: name the script where it lies.
        kv_hits = shutil.which("pd-kv-hits") or str(Path(sys.executable).parent / "pd-kv-hits")
        print(f"""
pdserve P/D cluster ready: {cluster.url}  (OpenAI API; model {Path(args.model).name})

  curl {cluster.url}/v1/completions -H 'Content-Type: application/json' \\
       -d '{{"prompt": "Hello, my name is", "max_tokens": 16, "temperature": 0}}'

  status:  curl {cluster.url}/status
  KV hits: {kv_hits} {logs}

Ctrl-C stops everything.""", flush=True)
        while all(c.alive for c in cluster.children):
            time.sleep(0.5)
        dead = next(c for c in cluster.children if not c.alive)
        print(f"{dead.name} exited with status {dead.proc.returncode}; stopping the cluster:\n{dead.tail()}",
              file=sys.stderr, flush=True)
        return 1
    except _Stop:
        return 0
    except RuntimeError as e:
        print(f"local_cluster: error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not leave children behind
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        codes = cluster.stop()
        print("stopped: " + ", ".join(f"{name} (exit {code})" for name, code in codes.items()), flush=True)


if __name__ == "__main__":
    sys.exit(main())
