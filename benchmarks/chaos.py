"""Chaos at load: each fault of tests/cluster/test_chaos.py under --requests concurrent streams, beside a no-fault run.

One local cluster (pd-proxy, 1 prefill + 2 decode nodes on the tiny model, redis behind a delaying
TCP relay; deploy/chaos.py, bench/chaos.py). Per scenario the same request set (greedy and seeded streams
over token-id prompts) runs with its own cache salt while one fault hits:

  none             no fault: the reference every other row's `exact` compares with
  redis frozen     redis SIGSTOPped for --hold seconds once streams run
  redis slow       every redis reply --delay seconds late for --hold seconds
  decode killed    one of the two decode nodes SIGKILLed once streams run (restarted after)
  decode frozen    one decode node SIGSTOPped for --hold seconds once streams run
  malformed        the malformed-request table sent while the streams run (its rows: bad input)

Columns: sent, ok (200 with a finish_reason), exact (ok and the no-fault tokens), failed (HTTP status:
count), truncated (200 without a finish_reason, or an in-band error), the worst request latency and
the worst gap between two tokens of one stream.

    .venv/bin/python benchmarks/chaos.py [--requests 200] [--hold 8] [--delay 1]
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tempfile
from pathlib import Path

from pdserve.bench.chaos import Tally, request_bodies, run_load
from pdserve.deploy.chaos import (ChaosCluster, frozen_decode, frozen_redis, killed_decode, send_malformed, slow_store,
                                  wait_tokens)
from pdserve.engine.builtin_model import default_model_path


def scenarios(chaos: ChaosCluster, args: argparse.Namespace) -> dict:
    start = max(20, args.requests)  # inject once a few tokens per stream have arrived

    async def malformed(progress):
        await wait_tokens(progress, start)
        return await send_malformed(chaos.url)

    return {
        "none": None,
        "redis frozen": frozen_redis(chaos, args.hold, start),
        "redis slow": slow_store(chaos, args.delay, args.hold),
        "decode killed": killed_decode(chaos, start),
        "decode frozen": frozen_decode(chaos, args.hold, start),
        "malformed": malformed,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200, help="concurrent streams per scenario")
    parser.add_argument("--hold", type=float, default=8.0, help="seconds a freeze or a slow store lasts")
    parser.add_argument("--delay", type=float, default=1.0, help="seconds added to each redis reply (redis slow)")
    parser.add_argument("--max-tokens", type=int, nargs=2, default=[32, 96], metavar=("MIN", "MAX"))
    parser.add_argument("--only", nargs="+", default=None, help="run only these scenarios (after none)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    bodies = request_bodies(args.requests, seed=11, max_tokens_range=tuple(args.max_tokens))
    with tempfile.TemporaryDirectory(prefix="pd-chaos-") as tmp:
        chaos = ChaosCluster(default_model_path("tiny"), Path(tmp))
        rows, reference, bad = [], None, []
        try:
            for name, fault in scenarios(chaos, args).items():
                if args.only and name != "none" and name not in args.only:
                    continue
                salt = "chaos-" + name.replace(" ", "-")
                outcomes, result = asyncio.run(run_load(chaos.url, bodies, salt, args.requests, fault))
                tally = Tally.of(name, outcomes, reference)
                if reference is None:
                    reference = {o.index: o.token_ids for o in outcomes}
                if name == "malformed":
                    bad = result
                rows.append(tally)
                print(tally.row() if len(rows) > 1 else Tally.header() + "\n" + tally.row(), flush=True)
                chaos.healthy()
        finally:
            chaos.stop()
    print(f"\n{args.requests} concurrent streamed completions per scenario (tiny model, 1 prefill + 2 decode "
          f"nodes, redis behind a relay); exact = same tokens as the no-fault run")
    print(Tally.header())
    for tally in rows:
        print(tally.row())
    if bad:
        print("\nmalformed requests (sent while the streams ran):")
        for what, expected, got, kind, secs in bad:
            print(f"  {what:<18} expected {expected}, got {got} ({kind}) in {secs * 1000:.0f} ms")
    clean = all(t.ok == t.exact == t.sent for t in rows) and all(e == g for _, e, g, _, _ in bad)
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
