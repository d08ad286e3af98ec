"""`pd-kv-hits LOG...`: what the KV store did for each request, read back from node logs.

Reads the one-line events of docs/architecture.md (Log lines) (lookup, load, save, fallback; request id first)
wherever they sit in a log line (any logging prefix is fine), plus LMCache's own wording
("Reqid: ..., LMCache hit tokens: ...", "[req_id=...] Retrieved R out of Q required
tokens ...", "[req_id=...] Stored S out of total T tokens ..."). Prefill and decode logs
share request ids, so passing both merges a request's save and load into one row.
"""
from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import IO, Iterable, Iterator

_NUM = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?|inf|nan"
_RID = r"(?:Reqid:\s*(?P<rid>.+?),|\[req_id=(?P<rid2>[^\]]+)\])\s*"
_COST = (rf"size:\s*(?P<gb>{_NUM})\s*gb,\s*cost\s*(?P<ms>{_NUM})\s*ms,\s*"
         rf"throughput:\s*(?P<gbps>{_NUM})\s*GB/s")

# (kind, LMCache's native wording?, pattern)
_PATTERNS: list[tuple[str, bool, re.Pattern[str]]] = [(kind, native, re.compile(rx, re.IGNORECASE))
                                                      for kind, native, rx in [
    ("lookup", False, _RID + r"Total tokens:?\s*(?P<total>\d+),\s*Local computed tokens:\s*(?P<local>\d+),\s*"
               r"KV hit tokens:\s*(?P<hit>\d+),\s*need to load:\s*(?P<need>\d+)"),
    ("lookup", True, _RID + r"Total tokens:?\s*(?P<total>\d+),\s*LMCache hit tokens:\s*(?P<hit>\d+),\s*"
               r"need to load:\s*(?P<need>\d+)"),
    ("load", False, _RID + r"Retrieved\s*(?P<retrieved>\d+)\s*tokens from token\s*(?P<start>\d+)\s*\(chunk-aligned;\s*"
             r"(?P<need>\d+)\s*needed,.*?\)\s*of\s*(?P<total>\d+)\s*total\.\s*" + _COST),
    ("load", True, _RID + r"Retrieved\s*(?P<retrieved>\d+)\s*out of\s*(?P<need>\d+)\s*required tokens\s*"
             r"\(from\s*(?P<total>\d+)\s*total tokens\)\.\s*" + _COST),
    ("save", False, _RID + r"Stored\s*(?P<stored>\d+)\s*tokens\s*\[(?P<a>\d+),\s*(?P<b>\d+)\)\s*of\s*(?P<total>\d+)"
             r"\s*\(skip_leading_tokens=(?P<skip>\d+)\)\.\s*" + _COST),
    ("save", True, _RID + r"Stored\s*(?P<stored>\d+)\s*out of total\s*(?P<total>\d+)\s*tokens\.\s*" + _COST),
    ("fallback", False, _RID + r"KV load failed\s*\((?P<reason>.*)\);\s*recomputing\s*(?P<need>\d+)\s*tokens"),
]]


@dataclass
class Event:
    kind: str  # lookup | load | save | fallback
    request_id: str
    values: dict[str, float | int | str]
    native: bool = False  # LMCache's own wording rather than docs/architecture.md's


@dataclass
class RequestKV:
    """Everything the logs said about one request (decode lookup/load, prefill save)."""

    request_id: str
    total_tokens: int | None = None
    local_computed: int | None = None
    hit_tokens: int | None = None
    need_to_load: int | None = None
    retrieved: int = 0
    load_gb: float = 0.0
    load_ms: float = 0.0
    loads: int = 0
    stored: int = 0
    save_gb: float = 0.0
    save_ms: float = 0.0
    fallback: str | None = None
    sources: dict[str, bool] = field(default_factory=dict, repr=False)  # kind -> native?

    @property
    def load_gbps(self) -> float | None:
        return self.load_gb / (self.load_ms / 1e3) if self.loads and self.load_ms > 0 else None

    @property
    def loaded(self) -> int:
        """Tokens that actually came from the store into new blocks (0 after a fallback)."""
        return 0 if self.fallback or not self.loads else (self.need_to_load or 0)

    @property
    def recomputed(self) -> int | None:
        if self.total_tokens is None:
            return None
        return max(0, self.total_tokens - (self.local_computed or 0) - self.loaded)


def _num(text: str) -> float | int:
    value = float(text)
    return int(value) if re.fullmatch(r"\d+", text) else value


def parse_line(line: str) -> Event | None:
    """The §5 / LMCache event in `line`, or None for any other log line."""
    if "req" not in line.lower():
        return None
    for kind, native, pattern in _PATTERNS:
        m = pattern.search(line)
        if m:
            groups = {k: v for k, v in m.groupdict().items() if v is not None}
            rid = (groups.pop("rid", None) or groups.pop("rid2")).strip()
            groups.pop("rid2", None)
            values = {k: (v.strip() if k == "reason" else _num(v)) for k, v in groups.items()}
            return Event(kind, rid, values, native)
    return None


class KVHitReport:
    """Folds events into per-request records, in first-seen order."""

    def __init__(self) -> None:
        self.requests: dict[str, RequestKV] = {}

    def add(self, event: Event) -> RequestKV:
        """Fold one event in. The LMCache connector logs both LMCache's native line and the section-5
        line for one transfer: the section-5 line wins, so a transfer is never counted twice."""
        rec = self.requests.setdefault(event.request_id, RequestKV(event.request_id))
        seen_native = rec.sources.get(event.kind)
        if event.native and seen_native is False:
            return rec
        if not event.native and seen_native:
            _reset(rec, event.kind)
        rec.sources[event.kind] = event.native
        v = event.values
        if event.kind == "lookup":  # a re-lookup (e.g. after preemption) replaces the earlier one
            rec.total_tokens, rec.hit_tokens, rec.need_to_load = int(v["total"]), int(v["hit"]), int(v["need"])
            if "local" in v:
                rec.local_computed = int(v["local"])
        elif event.kind == "load":
            rec.retrieved += int(v["retrieved"])
            rec.load_gb += float(v["gb"])
            rec.load_ms += float(v["ms"])
            rec.loads += 1
            rec.total_tokens = rec.total_tokens if rec.total_tokens is not None else int(v["total"])
            rec.need_to_load = rec.need_to_load if rec.need_to_load is not None else int(v["need"])
        elif event.kind == "save":
            rec.stored += int(v["stored"])
            rec.save_gb += float(v["gb"])
            rec.save_ms += float(v["ms"])
        else:
            rec.fallback = str(v["reason"])
        return rec

    def feed(self, lines: Iterable[str]) -> None:
        for line in lines:
            event = parse_line(line)
            if event is not None:
                self.add(event)

    def summary(self) -> dict[str, object]:
        looked = [r for r in self.requests.values() if r.total_tokens is not None and r.hit_tokens is not None]
        prompt = sum(r.total_tokens or 0 for r in looked)
        rates = sorted(r.load_gbps for r in self.requests.values() if r.load_gbps is not None)
        return {
            "requests": len(self.requests),
            "requests_with_lookup": len(looked),
            "prompt_tokens": prompt,
            "local_computed_tokens": sum(r.local_computed or 0 for r in looked),
            "hit_tokens": sum(r.hit_tokens or 0 for r in looked),
            "hit_rate": (sum(r.hit_tokens or 0 for r in looked) / prompt) if prompt else 0.0,
            "loaded_tokens": sum(r.loaded for r in looked),
            "recomputed_tokens": sum(r.recomputed or 0 for r in looked),
            "retrieved_tokens": sum(r.retrieved for r in self.requests.values()),
            "stored_tokens": sum(r.stored for r in self.requests.values()),
            "load_gb": sum(r.load_gb for r in self.requests.values()),
            "save_gb": sum(r.save_gb for r in self.requests.values()),
            "load_gbps_p50": _percentile(rates, 50),
            "load_gbps_p99": _percentile(rates, 99),
            "fallbacks": sum(1 for r in self.requests.values() if r.fallback),
            "fallback_reasons": sorted({r.fallback for r in self.requests.values() if r.fallback}),
        }

    def to_json(self) -> dict[str, object]:
        return {"requests": [_row(r) for r in self.requests.values()], "summary": self.summary()}


def _row(r: RequestKV) -> dict[str, object]:
    row = asdict(r)
    del row["sources"]
    row.update(load_gbps=r.load_gbps, loaded=r.loaded, recomputed=r.recomputed)
    return row


def _reset(rec: RequestKV, kind: str) -> None:
    if kind == "load":
        rec.retrieved, rec.load_gb, rec.load_ms, rec.loads = 0, 0.0, 0.0, 0
    elif kind == "save":
        rec.stored, rec.save_gb, rec.save_ms = 0, 0.0, 0.0


def _percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (None without data)."""
    if not sorted_values:
        return None
    rank = max(1, -(-len(sorted_values) * q // 100))
    return sorted_values[int(rank) - 1]


# GB, ms and GB/s describe the load (decode side); `stored` is what the prefill node saved.
_COLUMNS = ("request id", "total", "local", "hit", "need", "retrieved", "stored", "GB", "ms", "GB/s", "fallback")


def _cells(r: RequestKV) -> list[str]:
    def opt(v: int | None) -> str:
        return "-" if v is None else str(v)

    gbps = r.load_gbps
    return [r.request_id, opt(r.total_tokens), opt(r.local_computed), opt(r.hit_tokens), opt(r.need_to_load),
            str(r.retrieved), str(r.stored), f"{r.load_gb:.4f}", f"{r.load_ms:.1f}",
            "-" if gbps is None else f"{gbps:.3f}", r.fallback or ""]


def format_table(records: Iterable[RequestKV]) -> str:
    rows = [list(_COLUMNS)] + [_cells(r) for r in records]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) if i in (0, 10) else c.rjust(w) for i, (c, w) in
                               enumerate(zip(row, widths))).rstrip() for row in rows)


def format_summary(s: dict[str, object]) -> str:
    def gbps(v: object) -> str:
        return "-" if v is None else f"{v:.3f} GB/s"

    lines = [
        f"requests: {s['requests']} ({s['requests_with_lookup']} with a store lookup)",
        f"hit rate: {s['hit_rate']:.1%} of {s['prompt_tokens']} prompt tokens "
        f"({s['hit_tokens']} hit, {s['local_computed_tokens']} already local)",
        f"tokens loaded: {s['loaded_tokens']}, recomputed: {s['recomputed_tokens']}, "
        f"retrieved (chunk-aligned): {s['retrieved_tokens']}, stored by prefill: {s['stored_tokens']} "
        f"({s['save_gb']:.4f} GB)",
        f"load throughput: p50 {gbps(s['load_gbps_p50'])}, p99 {gbps(s['load_gbps_p99'])} "
        f"({s['load_gb']:.4f} GB loaded)",
        f"fallbacks: {s['fallbacks']}" + (f" ({'; '.join(s['fallback_reasons'])})" if s["fallbacks"] else ""),
    ]
    return "\n".join(lines)


def _follow(streams: list[IO[str]], poll_s: float = 0.2) -> Iterator[str]:
    """Yield lines as they are appended (like `tail -f`), forever; stdin ends at EOF."""
    while True:
        got = False
        for stream in list(streams):
            line = stream.readline()
            while line:
                got = True
                yield line
                line = stream.readline()
            if stream is sys.stdin:  # readline() returned '' at EOF
                streams.remove(stream)
        if not streams:
            return
        if not got:
            time.sleep(poll_s)


def _open(paths: list[str]) -> list[IO[str]]:
    streams: list[IO[str]] = []
    for path in paths:
        if path == "-":
            streams.append(sys.stdin)
            continue
        try:
            streams.append(open(path, encoding="utf-8", errors="replace"))
        except OSError as e:
            raise SystemExit(f"pd-kv-hits: error: cannot read {path}: {e.strerror}") from None
    return streams


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _stop_on_signals() -> None:
    """--follow ends with its summary on SIGINT or SIGTERM, even when started in the background
    (`nohup ... &`), where the shell leaves SIGINT ignored and Python then never installs its handler."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _interrupt)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pd-kv-hits", description="Per-request KV-store hits, loads, saves "
                                     "and fallbacks from pdserve (or LMCache) node logs.")
    parser.add_argument("logs", nargs="+", metavar="LOG", help="node log files; '-' reads stdin")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--follow", "-f", action="store_true",
                        help="keep reading appended lines; print a row per event; summary on Ctrl-C")
    args = parser.parse_args(argv)
    streams = _open(args.logs)
    report = KVHitReport()
    if args.follow:
        _stop_on_signals()
    try:
        if args.follow:
            for line in _follow(streams):
                event = parse_line(line)
                if event is None:
                    continue
                rec = report.add(event)
                out = json.dumps({"event": event.kind, **_row(rec)}) if args.json else "  ".join(_cells(rec))
                print(out, flush=True)
        else:
            for stream in streams:
                report.feed(stream)
    except KeyboardInterrupt:
        pass
    finally:
        for stream in streams:
            if stream is not sys.stdin:
                stream.close()
    if args.json:
        print(json.dumps(report.to_json() if not args.follow else {"summary": report.summary()}, indent=2))
    else:
        if not args.follow:
            print(format_table(report.requests.values()))
            print()
        print(format_summary(report.summary()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
