"""The results file of one `pd-bench` run: its JSON Schema, and the writer/reader that enforce it.

`pd-bench schema` prints the schema. Times in `requests[]` are seconds (`start` since the run
started); the summary gives milliseconds (`*_ms`) and rates per second. Version bumps
whenever a field changes meaning; `compare` refuses files of another version.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema

SCHEMA_VERSION = "pd-bench/1"

_NUM = {"type": ["number", "null"]}
_INT = {"type": ["integer", "null"]}
_DIST = {"type": "object", "required": ["mean", "p50", "p90", "p99"],
         "properties": {k: _NUM for k in ("mean", "p50", "p90", "p99")}, "additionalProperties": False}
_COUNTERS = {"type": "object", "additionalProperties": {"type": "number"}}

_REQUEST = {
    "type": "object",
    "required": ["session", "turn", "start", "ok", "status", "error", "ttft", "e2e", "itl", "prompt_tokens",
                 "output_tokens", "cached_tokens"],
    "additionalProperties": False,
    "properties": {
        "session": {"type": "string", "description": "conversation (user, document, trace session) id"},
        "turn": {"type": "integer", "minimum": 0, "description": "index of the turn within its session"},
        "start": {"type": "number", "description": "send time, seconds since the run started"},
        "ok": {"type": "boolean", "description": "HTTP 200 and at least one output token"},
        "status": {"type": "integer", "description": "HTTP status (0: no response)"},
        "error": {"type": ["string", "null"]},
        "ttft": {**_NUM, "description": "seconds from send to the first output token"},
        "e2e": {**_NUM, "description": "seconds from send to the end of the stream"},
        "itl": {"type": "array", "items": {"type": "number"},
                "description": "every inter-token gap, seconds (a chunk of k tokens gives k equal gaps)"},
        "prompt_tokens": {**_INT, "description": "usage.prompt_tokens"},
        "output_tokens": {"type": "integer", "minimum": 0, "description": "usage.completion_tokens, else counted"},
        "cached_tokens": {**_INT, "description": "usage.prompt_tokens_details.cached_tokens (null: not reported)"},
    },
}

_SUMMARY = {
    "type": "object",
    "required": ["requests", "completed", "failed", "duration_s", "request_throughput", "output_throughput",
                 "ttft_ms", "itl_ms", "e2e_ms", "prompt_tokens", "output_tokens", "cached_tokens",
                 "cached_fraction", "goodput", "kv"],
    "additionalProperties": False,
    "properties": {
        "requests": {"type": "integer"}, "completed": {"type": "integer"}, "failed": {"type": "integer"},
        "duration_s": {"type": "number", "description": "first send to last completed response"},
        "request_throughput": {**_NUM, "description": "completed requests per second"},
        "output_throughput": {**_NUM, "description": "output tokens of completed requests per second"},
        "ttft_ms": _DIST, "itl_ms": {**_DIST, "description": "over every gap of every completed request"},
        "e2e_ms": _DIST,
        "prompt_tokens": {"type": "integer"}, "output_tokens": {"type": "integer"},
        "cached_tokens": {**_INT, "description": "prompt tokens served from cache (sum over completed requests)"},
        "cached_fraction": _NUM,
        "goodput": {"oneOf": [{"type": "null"}, {
            "type": "object", "required": ["slo", "good_requests", "req_per_s", "fraction"],
            "additionalProperties": False,
            "description": "requests meeting every SLO (TTFT, mean ITL, E2E) per second of duration",
            "properties": {"slo": {"type": "object", "properties": {k: _NUM for k in ("ttft_ms", "itl_ms", "e2e_ms")},
                                   "additionalProperties": False},
                           "good_requests": {"type": "integer"}, "req_per_s": _NUM, "fraction": _NUM}}]},
        "kv": {"oneOf": [{"type": "null"}, {
            "type": "object", "additionalProperties": False,
            "description": "from the endpoint's /metrics deltas, summed over the nodes scraped",
            "properties": {k: _NUM for k in ("store_lookups", "store_hit_tokens", "store_loaded_tokens",
                                             "prompt_tokens_computed", "prefix_cache_hit_tokens",
                                             "prefix_cache_hit_rate")}}]},
    },
}

SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "pd-bench run",
    "type": "object",
    "required": ["schema", "label", "created", "endpoint", "workload", "load", "summary", "requests", "metrics"],
    "additionalProperties": False,
    "properties": {
        "schema": {"const": SCHEMA_VERSION},
        "label": {"type": "string", "description": "the run's name in tables and legends"},
        "created": {"type": "string", "description": "ISO 8601 UTC time the run started"},
        "endpoint": {"type": "object", "required": ["base_url", "api", "model"],
                     "properties": {"base_url": {"type": "string"}, "api": {"enum": ["chat", "completions"]},
                                    "model": {"type": "string"}}},
        "workload": {"type": "object", "required": ["name", "params"],
                     "properties": {"name": {"enum": ["multi-round-qa", "chat", "long-doc-qa", "random", "replay"]},
                                    "params": {"type": "object"}}},
        "load": {"type": "object", "required": ["pacing"],
                 "properties": {"pacing": {"type": "string", "description": "how requests were started, in words"}},
                 "description": "pacing and request options as given on the command line"},
        "summary": _SUMMARY,
        "requests": {"type": "array", "items": _REQUEST},
        "metrics": {"oneOf": [{"type": "null"}, {
            "type": "object", "required": ["urls", "before", "after", "delta", "timeline"],
            "additionalProperties": False,
            "properties": {
                "urls": {"type": "array", "items": {"type": "string"}},
                "before": _COUNTERS, "after": _COUNTERS, "delta": _COUNTERS,
                "timeline": {"type": "array", "items": {"type": "object", "required": ["t"],
                                                        "additionalProperties": {"type": "number"}},
                             "description": "KV-store, prefix-cache and prompt-computed counters sampled during the "
                                            "run; t: seconds since the start"}}}]},
    },
}


def validate(result: dict[str, Any]) -> None:
    """jsonschema.ValidationError when `result` does not match the schema."""
    jsonschema.validate(result, SCHEMA)


def write(result: dict[str, Any], path: Path) -> None:
    validate(result)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")


def load(path: Path) -> dict[str, Any]:
    """A results file, validated; ValueError with the file and the offending field otherwise."""
    try:
        result = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read a pd-bench result: {e}") from None
    try:
        validate(result)
    except jsonschema.ValidationError as e:
        where = "/".join(map(str, e.absolute_path)) or "(top level)"
        raise ValueError(f"{path}: not a {SCHEMA_VERSION} result: {where}: {e.message}") from None
    return result
