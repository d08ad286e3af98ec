"""pd-kvstore URL {stats,ls,verify,clear}: inspect and maintain a shared KV store (any model fingerprint).

Exit status: 0 ok (verify --repair: damage found was repaired), 1 verify found corrupt objects or damaged
chunks, 2 usage error or store unreachable.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from pdserve.kvstore import open_store, registry
from pdserve.kvstore.base import KVStore
from pdserve.kvstore.errors import StoreError


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB"


def _stats(store: KVStore, args: argparse.Namespace) -> int:
    usage = {fp: u for fp, u in store.inventory().items() if args.fingerprint in (None, fp)}
    if args.json:
        print(json.dumps({fp: {**asdict(u), "compression_ratio": round(u.compression_ratio, 4)}
                          for fp, u in usage.items()}, indent=1))
        return 0
    print(f"{'fingerprint':32}  {'chunks':>8}  {'objects':>9}  {'committed':>14}  {'in-flight':>12}  "
          f"{'orphaned':>12}  size")
    for fp, u in sorted(usage.items()):
        print(f"{fp:32}  {u.chunks:>8}  {u.objects:>9}  {u.committed_bytes:>14}  {u.inflight_bytes:>12}  "
              f"{u.orphaned_bytes:>12}  {_gib(u.bytes)}")
    for fp, u in sorted(usage.items()):
        by_codec = ", ".join(f"{name} {_gib(n)}" for name, n in sorted(u.codec_bytes.items()))
        print(f"{fp}  by codec: {by_codec or 'none'}; compression ratio {u.compression_ratio:.2f}x "
              f"({_gib(u.raw_bytes)} raw in {_gib(u.bytes)})")
    total = sum(u.bytes for u in usage.values())
    print(f"total: {len(usage)} fingerprint(s), {sum(u.chunks for u in usage.values())} committed chunk(s), "
          f"{total} bytes ({_gib(total)}): {sum(u.committed_bytes for u in usage.values())} committed, "
          f"{sum(u.inflight_bytes for u in usage.values())} in flight "
          f"({sum(u.inflight_chunks for u in usage.values())} chunk(s)), "
          f"{sum(u.orphaned_bytes for u in usage.values())} orphaned "
          f"({sum(u.orphaned_chunks for u in usage.values())} chunk(s))")
    return 0


def _ls(store: KVStore, args: argparse.Namespace) -> int:
    chunks = sorted(store.list_chunks(args.fingerprint), key=lambda c: (c.fingerprint, c.key))
    if args.json:
        print(json.dumps([asdict(c) for c in chunks], indent=1))
        return 0
    for c in chunks:
        state = "committed" if c.committed else "partial"
        print(f"{c.fingerprint}  {c.key}  {state:9}  {c.objects:>4} layers  {c.bytes:>12} bytes")
    return 0


def _verify(store: KVStore, args: argparse.Namespace) -> int:
    report = store.verify(args.fingerprint, repair=args.repair)
    for line in report.corrupt:
        print(f"CORRUPT {line}")
    for line in report.damaged:
        print(f"DAMAGED {line}")
    print(f"verified {report.objects} object(s), {report.bytes} bytes: {len(report.corrupt)} corrupt, "
          f"{len(report.damaged)} damaged chunk(s)")
    if args.repair:
        print(f"repaired: un-committed {report.repaired} chunk(s) (the next prefill of their prompts rewrites them)")
        return 0
    return 1 if report.corrupt or report.damaged else 0


def _clear(store: KVStore, args: argparse.Namespace) -> int:
    removed = store.clear(args.fingerprint)
    print(f"removed {removed} object(s)" + (f" of {args.fingerprint}" if args.fingerprint else ""))
    return 0


COMMANDS = {"stats": _stats, "ls": _ls, "verify": _verify, "clear": _clear}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pd-kvstore", description=__doc__.splitlines()[0])
    parser.add_argument("url", help=f"{registry.url_forms(registry.store_entries())} (query options as for open_store)")
    parser.add_argument("command", choices=COMMANDS, help="stats: counts and bytes per model fingerprint; "
                        "ls: chunks; verify: re-check every object's checksum and that it lies under its own key, and every "
                        "committed chunk's marker and layers; "
                        "clear: delete everything")
    parser.add_argument("--fingerprint", help="restrict to one model fingerprint")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per store operation (default 5)")
    parser.add_argument("--json", action="store_true", help="machine-readable output (stats, ls)")
    parser.add_argument("--repair", action="store_true", help="verify: un-commit every damaged chunk (the next "
                        "prefill rewrites it) instead of clearing the store")
    args = parser.parse_args(argv)
    try:
        with open_store(args.url, timeout=args.timeout, io_threads=1) as store:
            return COMMANDS[args.command](store, args)
    except (StoreError, ValueError) as exc:
        print(f"pd-kvstore: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
