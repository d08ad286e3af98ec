"""`pd-bench`: the command line. See bench/README.md for the workloads, the trace format and the outputs.

    pd-bench multi-round-qa --base-url http://127.0.0.1:8000/v1 --users 8 --rounds 4 --qps 2 \\
        --slo-ttft 500ms --slo-itl 50ms --label pd-redis
    pd-bench compare results/pd-file.json results/pd-redis.json -o results

Exit status: 0 when every request completed, 1 when some failed (results are written either
way), 2 on bad arguments or an unreachable endpoint.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import aiohttp

from pdserve.bench import report, schema, scrape, stats, workloads
from pdserve.bench.client import RequestOptions, server_root
from pdserve.bench.runner import LoadConfig, Runner
from pdserve.bench.server_tokenizer import ServerTokenizer

WORKLOADS = ("multi-round-qa", "chat", "long-doc-qa", "random", "replay")


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _duration(text: str) -> float:
    try:
        return stats.parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("endpoint")
    g.add_argument("--base-url", default="http://127.0.0.1:8000/v1",
                   help="OpenAI base URL (default http://127.0.0.1:8000/v1; /v1 is added to a bare host:port)")
    g.add_argument("--api", choices=("chat", "completions"), default="chat", help="endpoint (default chat)")
    g.add_argument("--model", default=None, help="model name (default: the first one /v1/models lists)")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default $OPENAI_API_KEY")
    g.add_argument("--tokenizer", default=None,
                   help="the served model's directory: its tokenizer sizes the prompts (default: the server's "
                        "/tokenize and /detokenize)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--ignore-eos", action="store_true", help="ask for exactly max_tokens (vLLM/pdserve extension)")
    g.add_argument("--no-token-ids", dest="token_ids", action="store_false",
                   help="do not send return_token_ids (count one token per chunk)")
    g.add_argument("--extra-body", type=_json_object, default={}, help="JSON merged into every request body")
    g.add_argument("--request-timeout", type=_positive_float, default=600.0, help="seconds between stream reads")
    g = p.add_argument_group("load")
    g.add_argument("--qps", type=_positive_float, default=None, help="request rate (default: as fast as allowed)")
    g.add_argument("--concurrency", type=_positive_int, default=None, help="most requests in flight")
    g.add_argument("--arrival", choices=("poisson", "uniform"), default="poisson", help="gaps between --qps arrivals")
    g.add_argument("--seed", type=int, default=0, help="seeds the text and the arrivals")
    g.add_argument("--warmup", type=int, default=0, help="short requests sent (and not counted) before the run")
    g = p.add_argument_group("measurement and output")
    g.add_argument("--slo-ttft", type=_duration, default=None, help="goodput SLO, e.g. 500ms")
    g.add_argument("--slo-itl", type=_duration, default=None, help="goodput SLO on a request's mean ITL, e.g. 50ms")
    g.add_argument("--slo-e2e", type=_duration, default=None, help="goodput SLO, e.g. 10s")
    g.add_argument("--metrics-url", action="append", default=None,
                   help="a pdserve /metrics URL to read KV counters from (repeatable; default: the endpoint's "
                        "own /metrics if it has pdserve metrics; 'none' disables)")
    g.add_argument("--metrics-interval", type=_positive_float, default=1.0, help="seconds between samples")
    g.add_argument("--output-dir", type=Path, default=Path("pd-bench-results"))
    g.add_argument("--label", default=None, help="the run's name in files, tables and legends (default: workload)")
    g.add_argument("--no-plots", dest="plots", action="store_false")
    g.add_argument("--no-progress", dest="progress", action="store_false")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pd-bench", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("multi-round-qa", help="U users x R rounds, shared system prompt, growing history")
    p.add_argument("--users", type=_positive_int, default=8)
    p.add_argument("--rounds", type=_positive_int, default=4)
    p.add_argument("--system-prompt-len", type=int, default=1000, help="tokens, shared by every user")
    p.add_argument("--user-info-len", type=int, default=500, help="tokens of each user's own context")
    p.add_argument("--question-len", type=int, default=30, help="tokens per question")
    p.add_argument("--answer-len", type=_positive_int, default=64, help="max_tokens per answer")
    p = sub.add_parser("chat", help="N chats of real text: shared system prompt, histories growing by user")
    p.add_argument("--num-requests", type=_positive_int, default=16)
    p.add_argument("--answer-len", type=_positive_int, default=128, help="max_tokens per answer")
    p = sub.add_parser("long-doc-qa", help="D documents, each asked several questions in shuffled order")
    p.add_argument("--documents", type=_positive_int, default=4)
    p.add_argument("--doc-len", type=int, default=4000, help="tokens per document")
    p.add_argument("--questions", type=_positive_int, default=4, help="questions per document")
    p.add_argument("--question-len", type=int, default=20)
    p.add_argument("--answer-len", type=_positive_int, default=32)
    p = sub.add_parser("random", help="independent prompts of fixed input and output lengths")
    p.add_argument("--num-requests", type=_positive_int, default=32)
    p.add_argument("--input-len", type=_positive_int, default=512)
    p.add_argument("--output-len", type=_positive_int, default=128)
    p = sub.add_parser("replay", help="a JSONL trace (see bench/README.md)")
    p.add_argument("file", type=Path)
    p.add_argument("--max-tokens", type=_positive_int, default=128, help="for lines that give no output length")
    p.add_argument("--limit", type=_positive_int, default=None, help="only the first N requests")
    p.add_argument("--time-scale", type=_positive_float, default=1.0,
                   help="multiply trace timestamps (0.5: twice as fast); ignored with --qps/--concurrency")
    for name in WORKLOADS:
        _common(sub.choices[name])
    p = sub.add_parser("compare", help="several results on the same axes, one table")
    p.add_argument("results", nargs="+", type=Path, help="JSON files written by pd-bench")
    p.add_argument("-o", "--output-dir", type=Path, default=Path("pd-bench-results"))
    p.add_argument("--no-plots", dest="plots", action="store_false")
    sub.add_parser("schema", help="print the JSON Schema of the results file")
    return parser


def normalize_base_url(url: str) -> str:
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"--base-url must be an http(s) URL, got {url!r}")
    url = url.rstrip("/")
    return url + "/v1" if parsed.path in ("", "/") else url


def make_workload(args: argparse.Namespace, maker: workloads.TextMaker) -> workloads.Workload:
    if args.command == "multi-round-qa":
        return workloads.multi_round_qa(maker, args.users, args.rounds, args.system_prompt_len, args.user_info_len,
                                        args.question_len, args.answer_len)
    if args.command == "chat":
        return workloads.chat(args.num_requests, args.answer_len)
    if args.command == "long-doc-qa":
        return workloads.long_doc_qa(maker, args.documents, args.doc_len, args.questions, args.question_len,
                                     args.answer_len)
    if args.command == "random":
        return workloads.random_lengths(maker, args.num_requests, args.input_len, args.output_len)
    return workloads.replay(args.file, maker, args.max_tokens, args.limit)


async def _first_model(base_url: str, headers: dict[str, str]) -> str:
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=30)) as http:
        async with http.get(base_url + "/models") as resp:
            if resp.status != 200:
                raise ValueError(f"GET {base_url}/models: HTTP {resp.status}; give --model")
            return (await resp.json())["data"][0]["id"]


def pacing(workload: workloads.Workload, args: argparse.Namespace) -> str:
    """How requests were started, in words (runner.py's rules)."""
    if workload.timed and not (args.qps or args.concurrency):
        return f"trace timestamps x {args.time_scale:g}"
    parts = [f"{args.arrival} arrivals at {args.qps:g} req/s" if args.qps else "",
             f"at most {args.concurrency} in flight" if args.concurrency else ""]
    return ", ".join(p for p in parts if p) or "every ready request at once"


def run(args: argparse.Namespace) -> int:
    base_url = normalize_base_url(args.base_url)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model or asyncio.run(_first_model(base_url, headers))
    if args.tokenizer:
        from pdserve.engine.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
    else:  # asked only when a workload needs a length: a replay of fixed prompts never calls it
        tokenizer = ServerTokenizer(server_root(base_url), model, headers, timeout_s=min(60.0, args.request_timeout))
    workload = make_workload(args, workloads.TextMaker(args.seed, tokenizer))
    if args.api == "chat" and any(t.token_ids is not None for s in workload.sessions for t in s.turns):
        raise ValueError("the trace gives prompts as token ids: use --api completions")
    opts = RequestOptions(api=args.api, model=model, temperature=args.temperature, ignore_eos=args.ignore_eos,
                          return_token_ids=args.token_ids, extra_body=args.extra_body, headers=headers)
    load = LoadConfig(qps=args.qps, concurrency=args.concurrency, arrival=args.arrival,
                      time_scale=getattr(args, "time_scale", 1.0), seed=args.seed,
                      request_timeout_s=args.request_timeout, metrics_interval_s=args.metrics_interval,
                      progress=args.progress, warmup=args.warmup)
    if args.metrics_url == ["none"]:
        scraper = None
    else:
        scraper = scrape.Scraper(args.metrics_url or [scrape.metrics_url(base_url)], quiet=not args.metrics_url)
    result = asyncio.run(Runner(workload, base_url, opts, load, scraper).run())

    requests = [r.to_json() for r in result.records]
    slo = stats.SLO(args.slo_ttft, args.slo_itl, args.slo_e2e)
    metrics = result.metrics
    label = args.label or workload.name
    out = {
        "schema": schema.SCHEMA_VERSION, "label": label,
        "created": datetime.datetime.fromtimestamp(result.started_unix, datetime.timezone.utc).isoformat(),
        "endpoint": {"base_url": base_url, "api": args.api, "model": model},
        "workload": {"name": workload.name, "params": workload.params},
        "load": {"pacing": pacing(workload, args), "qps": args.qps, "concurrency": args.concurrency,
                 "arrival": args.arrival, "seed": args.seed,
                 "temperature": args.temperature, "ignore_eos": args.ignore_eos, "warmup": args.warmup,
                 **({"time_scale": args.time_scale} if args.command == "replay" else {})},
        "summary": stats.summarize(requests, slo, metrics["delta"] if metrics else None),
        "requests": requests, "metrics": metrics,
    }
    json_path = args.output_dir / f"{label}.json"
    schema.write(out, json_path)
    table = f"{report.describe(out)}\n\n{report.text_table([out])}"
    (args.output_dir / f"{label}.txt").write_text(table + "\n")
    print(table)
    written = [json_path]
    if args.plots:
        from pdserve.bench import plots  # matplotlib: only when drawing

        written += plots.write_plots([out], args.output_dir, prefix=f"{label}-")
    print("\nwrote " + ", ".join(map(str, written)))
    failed = out["summary"]["failed"]
    if failed:
        errors = sorted({r["error"] for r in requests if r["error"]})
        print(f"pd-bench: {failed} of {len(requests)} requests failed; first error: {errors[0]}", file=sys.stderr)
    return 1 if failed else 0


def compare(args: argparse.Namespace) -> int:
    results = [schema.load(p) for p in args.results]
    labels = [r["label"] for r in results]
    for i, r in enumerate(results):  # two runs with one label would share a legend entry
        if labels.count(r["label"]) > 1:
            r["label"] = f"{r['label']} ({args.results[i].stem})"
    args.output_dir.mkdir(parents=True, exist_ok=True)
    captions = report.captions(results)
    md = "\n".join(captions) + "\n\n" + report.markdown_table(results) + "\n"
    (args.output_dir / "compare.md").write_text(md)
    print("\n".join(captions) + "\n\n" + report.text_table(results))
    written = [args.output_dir / "compare.md"]
    if args.plots:
        from pdserve.bench import plots

        written += plots.write_plots(results, args.output_dir, prefix="compare-")
    print("\nwrote " + ", ".join(map(str, written)))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="pd-bench: %(message)s")
    try:
        if args.command == "schema":
            print(json.dumps(schema.SCHEMA, indent=1))
            return 0
        if args.command == "compare":
            return compare(args)
        return run(args)
    except (ValueError, OSError, aiohttp.ClientError, workloads.TraceError) as e:
        print(f"pd-bench: error: {e}", file=sys.stderr)
        return 2
