"""The KV hand-off across a real network link, against the link's own ceiling, with each stored KV codec.

The store (redis-server; and lmcache_server with --stores lmcache) runs in its own network namespace,
the decode side in another, joined by one veth pair whose store end is shaped with `tc`
(deploy/netns.py). For each link setting (1, 10 and 25 Gbit/s, each with no added delay and with 0.1 and
1 ms one-way delay where the kernel has sch_netem; the unshaped veth as the reference), in one run, on the real model:

  ceiling    a plain TCP transfer of the prompt's KV bytes over the same link (deploy/netns.py)
  load only  the decode connector's real load path for one prompt, no forward pass competing
             (benchmarks/kv_load_only.py), in GB/s and as a share of the ceiling; goal >= 80%
  TTFT       decode-side time to first token with the KV loaded, per codec, at 2k and 8k tokens,
             against the decode engine recomputing the prompt (which no link affects)

The prompts are stored once per codec (the producer writes through the unshaped link, and its
own TTFT per codec shows what encoding costs the prefill's critical path); the consumer runs with
local prefix caching off so every measurement loads from the store. Best of --repeats each.

    sudo .venv/bin/python benchmarks/kv_link.py [--model smollm2] [--lengths 2048 8000]
        [--rates 1 10 25] [--delays 0.1 1] [--codecs raw lossless int8 fp8] [--stores redis lmcache]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

from pdserve.deploy.netns import Link, NetnsError, Shape, plain_transfer, start_sender
from pdserve.engine.builtin_model import preset_checkpoint
from pdserve.serving import LLM, SamplingParams

import kv_load_only
from engine_throughput import prompts
from machine import describe

FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
ENGINE_KW = dict(kv_cache_memory="1GiB")
REDIS_PORT, LMCACHE_PORT, SENDER_PORT = 6379, 6380, 7001
LOAD_SHARE_GOAL = 0.8
AGREE_TOKENS = 16


def model_dir(name: str) -> Path:
    path = Path(name)
    return path if path.is_dir() else preset_checkpoint(name)[0]


def store_url(store: str, address: str, codec: str) -> str:
    if store == "redis":
        return f"redis://{address}:{REDIS_PORT}/0" + ("" if codec == "raw" else f"?codec={codec}")
    return f"lm://{address}:{LMCACHE_PORT}"


def timed_first_token(llm: LLM, prompt: list[int]) -> float:
    start = time.perf_counter()
    llm.generate([prompt], FIRST_TOKEN)
    return time.perf_counter() - start


# ---------------------------------------------------------------- the decode side (inside its namespace)

def store_prompts(model: Path, url: str, lengths: list[int], seed: int) -> tuple[dict[int, list[int]], dict[int, float]]:
    """Prefill one fresh prompt per length into the store through a producer; its TTFT per length."""
    producer = LLM(str(model), kv_store=url, kv_role="kv_producer", **ENGINE_KW)
    try:
        timed_first_token(producer, prompts(1, 64, seed - 1)[0])  # warm-up
        stored, ttft = {}, {}
        for n in lengths:
            stored[n] = prompts(1, n, seed + n)[0]
            ttft[n] = timed_first_token(producer, stored[n])
        return stored, ttft  # generate() returns once the request's saves are committed
    finally:
        producer.engine.shutdown()


def consumer_ttft(consumer: LLM, prompt: list[int], repeats: int) -> tuple[float, float, int]:
    """(best TTFT s, load GB/s of that run, bytes moved) of a prompt whose KV is in the store; the load's
    seconds are the connector's own (pdserve_kv_load_seconds), its bytes what crossed the link."""
    metrics = consumer.engine.connector.metrics
    best = (float("inf"), 0.0, 0)
    for _ in range(repeats):
        nbytes, secs = metrics.value("pdserve_kv_load_bytes_total"), metrics.value("pdserve_kv_load_seconds_sum")
        ttft = timed_first_token(consumer, prompt)
        loaded = metrics.value("pdserve_kv_load_bytes_total") - nbytes
        if loaded <= 0:
            raise RuntimeError(f"the consumer loaded nothing for a {len(prompt)}-token prompt")
        gbps = loaded / 1e9 / max(metrics.value("pdserve_kv_load_seconds_sum") - secs, 1e-9)
        best = min(best, (ttft, gbps, int(loaded)), key=lambda r: r[0])
    return best


def decode_side(cfg: dict) -> dict:
    model, link = Path(cfg["model"]), Link(cfg["tag"], cfg["net"])
    lengths, repeats = cfg["lengths"], cfg["repeats"]
    result: dict = {"machine": describe(), "settings": [], "skipped": [], "codecs": {}}
    recompute_llm = LLM(str(model), **ENGINE_KW)
    timed_first_token(recompute_llm, prompts(1, 64, 1)[0])
    result["recompute"] = {n: min(timed_first_token(recompute_llm, p) for p in prompts(repeats, n, 2 + n))
                           for n in lengths}

    stored: dict[str, dict[str, dict[int, list[int]]]] = {}
    for store in cfg["stores"]:
        for i, codec in enumerate(cfg["codecs"] if store == "redis" else ["raw"]):
            url = store_url(store, link.store_address, codec)
            try:
                prompts_by_len, ttft = store_prompts(model, url, lengths, seed=1000 * (i + 1) + 17 * len(stored))
            except ValueError as exc:  # a codec this build does not know
                result["skipped"].append(f"{store} codec={codec}: {exc}")
                continue
            stored.setdefault(store, {})[codec] = prompts_by_len
            result["codecs"][f"{store}/{codec}"] = {"producer_ttft": ttft}

    raw_producer = LLM(str(model), kv_store=store_url("redis", link.store_address, "raw"), kv_role="kv_producer",
                       **ENGINE_KW)
    consumers = {store: LLM(str(model), kv_store=store_url(store, link.store_address, "raw"), kv_role="kv_consumer",
                            enable_prefix_caching=False, **ENGINE_KW) for store in stored}
    kv_bytes = {}
    shapes = [Shape(r, d) for r in cfg["rates"] for d in sorted({0.0, *cfg["delays"]})]
    for setting in [Shape(None), *shapes]:
        try:
            qdisc = link.shape(setting)
        except NetnsError as exc:
            result["skipped"].append(f"{setting}: {exc}")
            continue
        row: dict = {"setting": str(setting), "rate_gbit": setting.rate_gbit, "delay_ms": setting.delay_ms,
                     "qdisc": qdisc, "ttft": {}}
        for store, by_codec in stored.items():
            for codec, prompts_by_len in by_codec.items():
                for n, prompt in prompts_by_len.items():
                    ttft, gbps, nbytes = consumer_ttft(consumers[store], prompt, repeats)
                    row["ttft"].setdefault(f"{store}/{codec}", {})[n] = {"s": ttft, "load_gbps": gbps, "bytes": nbytes}
                    if codec == "raw" and store == "redis":
                        kv_bytes[n] = nbytes
        big = max(lengths)
        row["ceiling_gbps"] = kv_bytes[big] / plain_transfer(link.store_address, SENDER_PORT, kv_bytes[big],
                                                                max(3, repeats)) / 1e9
        alone = kv_load_only.measure(raw_producer, store_url("redis", link.store_address, "raw"), cfg["load_tokens"],
                                     repeats, seed=4242)
        row["load_only_gbps"], row["redis_raw_gbps"] = alone.load, alone.raw
        result["settings"].append(row)
        print(f"done: {setting} ({qdisc})", file=sys.stderr, flush=True)
    link.shape(Shape(None))
    result["agreement"] = agreement(recompute_llm, consumers, stored, min(lengths))
    for llm in (recompute_llm, raw_producer, *consumers.values()):
        llm.engine.shutdown()
    return result


def agreement(recompute: LLM, consumers: dict[str, LLM], stored: dict, length: int) -> dict[str, list[int]]:
    """{store/codec: [greedy tokens equal to the recompute's before the first difference, of AGREE_TOKENS]} for
    the stored prompt of `length` tokens: raw and lossless must agree on all; lossy codecs are measured."""
    greedy = SamplingParams(max_tokens=AGREE_TOKENS, temperature=0.0, ignore_eos=True)
    out = {}
    for store, by_codec in stored.items():
        for codec, prompts_by_len in by_codec.items():
            prompt = prompts_by_len[length]
            want = recompute.generate([prompt], greedy)[0].outputs[0].token_ids
            got = consumers[store].generate([prompt], greedy)[0].outputs[0].token_ids
            same = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), len(want))
            out[f"{store}/{codec}"] = [same, len(want)]
    return out


# ---------------------------------------------------------------- the report

def with_int_lengths(result: dict) -> dict:
    """The decode side's figures with their prompt lengths as ints again (JSON made the keys strings)."""
    result["recompute"] = {int(n): s for n, s in result["recompute"].items()}
    for info in result["codecs"].values():
        info["producer_ttft"] = {int(n): s for n, s in info["producer_ttft"].items()}
    for row in result["settings"]:
        row["ttft"] = {name: {int(n): cell for n, cell in by_len.items()} for name, by_len in row["ttft"].items()}
    return result


def report(result: dict, lengths: list[int]) -> list[str]:
    lines = [result["machine"], "decode-side TTFT in ms, best of the repeats (speed-up vs recompute in brackets); "
             "ceiling = a plain TCP transfer of the same bytes over the same link; load only = the connector's "
             "load path with no forward pass competing"]
    lines.append("recompute (no link): " + ", ".join(f"{n} tokens {s * 1000:.0f} ms"
                                                      for n, s in result["recompute"].items()))
    for name, info in result["codecs"].items():
        lines.append(f"producer TTFT with {name}: " + ", ".join(f"{n} tokens {s * 1000:.0f} ms"
                                                               for n, s in info["producer_ttft"].items()))
    names = sorted({k for row in result["settings"] for k in row["ttft"]}, key=lambda k: (k.split("/")[0], k))
    head = f"{'link':>22} {'ceiling':>8} {'load only':>14}"
    for n in lengths:
        head += "".join(f" {name + '@' + str(n):>24}" for name in names)
    lines.append(head)
    for row in result["settings"]:
        share = row["load_only_gbps"] / row["ceiling_gbps"]
        line = f"{row['setting']:>22} {row['ceiling_gbps']:6.2f}GB {row['load_only_gbps']:6.2f} ({100 * share:3.0f}%)"
        for n in lengths:
            for name in names:
                cell = row["ttft"].get(name, {}).get(n)
                if cell is None:
                    line += f" {'-':>24}"
                    continue
                speedup = result["recompute"][n]
                line += f" {cell['s'] * 1000:9.0f} ({speedup / cell['s']:5.1f}x){'':>7}"
        lines.append(line)
    lines += load_times(result, max(lengths))
    lines += crossover(result, lengths)
    lines.append(f"greedy agreement with recompute over {AGREE_TOKENS} tokens at {min(lengths)} tokens: " + ", ".join(
        f"{name} {same}/{total}" for name, (same, total) in result["agreement"].items()))
    for skip in result["skipped"]:
        lines.append(f"skipped: {skip}")
    shares = [row["load_only_gbps"] / row["ceiling_gbps"] for row in result["settings"] if row["rate_gbit"]]
    if shares:
        worst = min(shares)
        lines.append(f"goal (raw load only >= {100 * LOAD_SHARE_GOAL:.0f}% of the link's ceiling on every shaped link): "
                     f"worst {100 * worst:.0f}% " + ("met" if worst >= LOAD_SHARE_GOAL else "NOT met"))
    return lines


def load_times(result: dict, n: int) -> list[str]:
    """The loads alone at `n` tokens (the connector's load seconds inside those TTFTs): ms and MB moved per
    codec, and each codec's speed-up over raw on the same link."""
    out = [f"the load inside the TTFT at {n} tokens (connector's own seconds; MB that crossed the link):"]
    for row in result["settings"]:
        cells = {name: by_len.get(n) for name, by_len in row["ttft"].items()}
        raw = cells.get("redis/raw")
        parts = []
        for name, c in sorted(cells.items()):
            if not c:
                continue
            ms = c["bytes"] / c["load_gbps"] / 1e6
            note = f", {raw['bytes'] / raw['load_gbps'] / 1e6 / ms:.2f}x raw" if raw and name != "redis/raw" else ""
            parts.append(f"{name} {ms:.0f} ms / {c['bytes'] / 1e6:.0f} MB{note}")
        out.append(f"  {row['setting']:>20}: " + "; ".join(parts))
    return out


def crossover(result: dict, lengths: list[int]) -> list[str]:
    """Per codec and length: the shaped links where it beats raw redis, and its speed-up there."""
    out = []
    for n in lengths:
        for row in result["settings"]:
            cells = {name: by_len.get(n) for name, by_len in row["ttft"].items()}
            raw = cells.get("redis/raw")
            if raw is None:
                continue
            wins = [f"{name.split('/')[1]} {raw['s'] / c['s']:.2f}x" for name, c in cells.items()
                    if name.startswith("redis/") and name != "redis/raw" and c]
            if wins:
                out.append(f"{n} tokens over {row['setting']}: codec TTFT speed-up vs raw: " + ", ".join(wins))
    return out


# ---------------------------------------------------------------- the orchestrator (root namespace)

@contextlib.contextmanager
def store_host(link: Link, stores: list[str]) -> Iterator[None]:
    procs = [start_sender(link, SENDER_PORT)]
    addr = link.store_address
    if "redis" in stores:
        procs.append(subprocess.Popen(link.exec_argv(link.store_ns, [
            "redis-server", "--bind", addr, "--port", str(REDIS_PORT), "--save", "", "--appendonly", "no",
            "--protected-mode", "no", "--maxmemory", "8gb"]), stdout=subprocess.DEVNULL))
    if "lmcache" in stores:
        server = str(Path(sys.executable).with_name("lmcache_server"))
        procs.append(subprocess.Popen(link.exec_argv(link.store_ns, [server, addr, str(LMCACHE_PORT), "cpu"]),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    try:
        time.sleep(1.0)
        for proc in procs:
            if proc.poll() is not None:
                raise NetnsError(f"{proc.args[-3:]} exited with {proc.returncode} in the store namespace")
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="HF directory or preset (default: the real model)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8000])
    parser.add_argument("--rates", type=float, nargs="+", default=[1, 10, 25], help="Gbit/s")
    parser.add_argument("--delays", type=float, nargs="+", default=[0.1, 1.0], help="one-way ms (needs sch_netem)")
    parser.add_argument("--codecs", nargs="+", default=["raw", "lossless", "int8", "fp8"])
    parser.add_argument("--stores", nargs="+", default=["redis"], choices=["redis", "lmcache"])
    parser.add_argument("--load-tokens", type=int, default=2048, help="prompt length of the load-only figure")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write the raw figures here")
    parser.add_argument("--decode-side", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.decode_side:  # inside the decode namespace: the config comes on stdin as JSON
        print(json.dumps(decode_side(json.load(sys.stdin))))
        return 0
    model = model_dir(args.model)  # made (downloaded, converted) before any namespace exists
    link = Link()
    cfg = {"model": str(model), "tag": link.tag, "net": link.net, "lengths": args.lengths, "rates": args.rates,
           "delays": args.delays, "codecs": args.codecs, "stores": args.stores, "repeats": args.repeats,
           "load_tokens": args.load_tokens}
    with link, store_host(link, args.stores):
        proc = subprocess.run(link.exec_argv(link.decode_ns, [sys.executable, str(Path(__file__).resolve()),
                                                              "--decode-side"]),
                              input=json.dumps(cfg), stdout=subprocess.PIPE, text=True, timeout=7200,
                              cwd=Path(__file__).resolve().parents[1])
    if proc.returncode != 0:
        return 1
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print("\n".join(report(with_int_lengths(result), args.lengths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
