"""Which `--kv-load-mode` should be the default: async, layerwise or auto, measured.

On the `bench` model with a producer and a consumer engine in this process, per mode:
  lone TTFT    one request alone, its whole prompt (but the last token) in the store: time to
               its first token (layer-wise loading overlaps reads with the forward pass; async
               loading parks the request until the read is done, then runs a step)
  batch        --batch such requests arriving together beside nothing else: time until all
               produced their first token
  stream gap   the largest gap between two tokens of a running stream while one request loads
               through a store whose every reply is --delay-ms late (deploy.fault_relay in
               front of redis): how much one request's load costs another's stream
  newcomer     time to first token of a short request (no store hit) that arrives 20 ms after a
               lone request started loading through that slow store: what a request that
               arrives during someone else's layer-wise load pays
Each figure is the best (TTFT, batch) or the worst (gap) of --repeats, each with fresh prompts.

    .venv/bin/python benchmarks/kv_load_modes.py [--store file|redis] [--tokens 2048] [--repeats 3]
"""
from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

from pdserve.deploy.fault_relay import FaultRelay
from pdserve.serving import LLM, SamplingParams
from pdserve.engine.config import KV_LOAD_MODES

from engine_throughput import bench_model_path, prompts
from kv_handoff import backend

FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
STREAM = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
ENGINE_KW = dict(kv_cache_memory="2GiB", load_timeout_s=60.0, dtype="float32")  # fp32: runs on any x86 CPU


def first_tokens(llm: LLM, batch: list[list[int]]) -> float:
    start = time.perf_counter()
    outs = llm.generate(batch, FIRST_TOKEN)
    elapsed = time.perf_counter() - start
    assert all(o.num_cached_tokens == len(p) - 1 for o, p in zip(outs, batch)), "a load fell back to recompute"
    return elapsed


def stream_gap(consumer: LLM, producer: LLM, relay: FaultRelay, delay_s: float, tokens: int, seed: int) -> float:
    """Largest inter-token gap of a running stream while another request's KV loads through the relay."""
    engine = consumer.engine
    engine.add_request("stream", prompts(1, 64, seed)[0], STREAM)
    while not engine.scheduler.running or not engine.scheduler.running[0].output_token_ids:
        engine.step()
    loading = prompts(1, tokens, seed + 1)[0]
    producer.generate([loading], FIRST_TOKEN)
    relay.delay_s = delay_s
    engine.add_request("loading", loading, FIRST_TOKEN)
    last, gap, done = time.perf_counter(), 0.0, False
    while not done:
        for out in engine.step():
            now = time.perf_counter()
            if out.request_id == "stream" and out.new_token_ids:
                gap, last = max(gap, now - last), now
            done |= out.request_id == "loading" and out.finished
    relay.delay_s = 0.0
    engine.abort_request("stream")
    return gap


def newcomer_ttft(consumer: LLM, producer: LLM, relay: FaultRelay, delay_s: float, tokens: int, seed: int) -> float:
    """TTFT of a short request arriving while a lone request's KV loads through the relay."""
    engine = consumer.engine
    loading = prompts(1, tokens, seed)[0]
    producer.generate([loading], FIRST_TOKEN)
    relay.delay_s = delay_s
    engine.add_request("loading", loading, FIRST_TOKEN)
    started = time.perf_counter()
    added = None
    ttft = None
    while ttft is None or engine.has_unfinished_requests():
        if added is None and time.perf_counter() - started >= 0.02:
            engine.add_request("newcomer", prompts(1, 16, seed + 1)[0], FIRST_TOKEN)
            added = time.perf_counter()
        for out in engine.step():
            if out.request_id == "newcomer" and out.finished:
                ttft = time.perf_counter() - added
    relay.delay_s = 0.0
    return ttft


def bench_mode(model: Path, url: str, relay_url: str, relay: FaultRelay, mode: str, args) -> dict[str, float]:
    producer = LLM(str(model), kv_store=url, kv_role="producer", **ENGINE_KW)
    consumer = LLM(str(model), kv_store=url, kv_role="consumer", kv_load_mode=mode, **ENGINE_KW)
    slow = LLM(str(model), kv_store=relay_url, kv_role="consumer", kv_load_mode=mode, **ENGINE_KW)
    seed = 1000 * KV_LOAD_MODES.index(mode)
    warm = prompts(1, 300, seed)[0]
    producer.generate([warm], FIRST_TOKEN)
    first_tokens(consumer, [warm])
    lone, batch, gap, newcomer = float("inf"), float("inf"), 0.0, 0.0
    for r in range(args.repeats):
        one = prompts(1, args.tokens, seed + 10 * r + 1)
        many = prompts(args.batch, args.tokens // 4, seed + 10 * r + 2)
        producer.generate(one + many, FIRST_TOKEN)
        lone = min(lone, first_tokens(consumer, one))
        batch = min(batch, first_tokens(consumer, many))
        gap = max(gap, stream_gap(slow, producer, relay, args.delay_ms / 1000, args.tokens, seed + 10 * r + 3))
        newcomer = max(newcomer, newcomer_ttft(slow, producer, relay, args.delay_ms / 1000, args.tokens,
                                               seed + 10 * r + 5))
    for llm in (producer, consumer, slow):
        llm.engine.shutdown()
    return {"lone": lone, "batch": batch, "gap": gap, "newcomer": newcomer}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", choices=["file", "redis"], default="redis",
                        help="store of the TTFT figures (the gap always uses redis behind the relay)")
    parser.add_argument("--tokens", type=int, default=2048, help="prompt tokens of the lone request")
    parser.add_argument("--batch", type=int, default=8, help="requests of tokens/4 each arriving together")
    parser.add_argument("--delay-ms", type=float, default=200.0, help="reply delay of the slow store")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=list(KV_LOAD_MODES), choices=KV_LOAD_MODES)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    model = bench_model_path()
    tmp = Path(tempfile.mkdtemp(prefix="kv-load-modes-"))
    results = {}
    try:
        with backend("redis", tmp) as redis_url:
            host_port = redis_url.removeprefix("redis://").split("/")[0]
            relay = FaultRelay("127.0.0.1", int(host_port.rsplit(":", 1)[1]))
            relay.start()
            try:
                url = redis_url if args.store == "redis" else f"file://{tmp / 'store'}"
                for mode in args.modes:
                    results[mode] = bench_mode(model, url, f"redis://127.0.0.1:{relay.port}/0", relay, mode, args)
            finally:
                relay.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"bench model, {args.store} store; lone: {args.tokens}-token prompt; batch: {args.batch} x "
          f"{args.tokens // 4} tokens; gap: a stream's worst inter-token gap while one {args.tokens}-token "
          f"load goes through redis with {args.delay_ms:g} ms per reply")
    print(f"{'mode':>10} {'lone TTFT ms':>13} {'batch ms':>9} {'stream gap ms':>14} {'newcomer TTFT ms':>17}")
    for mode, r in results.items():
        print(f"{mode:>10} {r['lone'] * 1000:13.1f} {r['batch'] * 1000:9.1f} {r['gap'] * 1000:14.1f} "
              f"{r['newcomer'] * 1000:17.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
