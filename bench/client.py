"""One streaming request to an OpenAI-compatible endpoint, timed token by token.

Token arrival times come from the SSE chunks. With `return_token_ids` (pdserve and vLLM send
the ids of each chunk) a chunk's token count is exact; otherwise each chunk with text counts
as one token (what most servers send). A chunk carrying k tokens contributes k inter-token
gaps of equal share of the time since the previous chunk, the rule the servers' own ITL
histograms use (serving/metrics.py), so client and server ITL percentiles are comparable.
TTFT is the time from sending the request to the first chunk with output.

`stream` is this one timing client for a body of one's own (the benchmarks, the chaos harness); `send`
builds pd-bench's body for a workload's turn and streams it. Besides those figures a record keeps what
the stream said (token ids, finish reason, usage's completion_tokens) and each gap between two chunks
with output (`chunk_gaps`: vLLM's bench client's ITL, which counts a chunk of k tokens as one gap).
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pdserve.bench.workloads import Session, Turn, render_text


@dataclass
class RequestOptions:
    api: str = "chat"  # chat | completions
    model: str = ""
    temperature: float = 0.0
    ignore_eos: bool = False
    return_token_ids: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)  # e.g. Authorization


@dataclass
class RequestRecord:
    """Everything measured about one request; times in seconds, `start` relative to the run's start."""

    session: str
    turn: int
    start: float
    ok: bool = False
    status: int = 0
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int = 0
    cached_tokens: int | None = None
    # what the stream said, kept out of the JSON record
    answer: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int | None = None  # usage's count; None when the stream had no usage
    chunk_gaps: list[float] = field(default_factory=list)  # between consecutive chunks with output

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k not in _NOT_IN_JSON}
        out["itl"] = [round(g, 6) for g in self.itl]
        for key in ("start", "ttft", "e2e"):
            if out[key] is not None:
                out[key] = round(out[key], 6)
        return out


_NOT_IN_JSON = ("answer", "token_ids", "finish_reason", "completion_tokens", "chunk_gaps")


def server_root(base_url: str) -> str:
    """`http://h:p/v1` -> `http://h:p`: where a server's /tokenize, /detokenize and /metrics live."""
    root = base_url.rstrip("/")
    return root[:-3] if root.endswith("/v1") else root


def build_body(session: Session, turn: Turn, opts: RequestOptions) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of the turn's streaming request."""
    body: dict[str, Any] = {"model": opts.model, "max_tokens": turn.max_tokens, "temperature": opts.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if opts.api == "chat":
        if turn.token_ids is not None:
            raise ValueError("a prompt given as token ids needs --api completions")
        path, body["messages"] = "/chat/completions", session.messages(turn)
    else:
        path = "/completions"
        body["prompt"] = turn.token_ids if turn.token_ids is not None else render_text(session.messages(turn))
    if opts.ignore_eos:
        body["ignore_eos"] = True
    if opts.return_token_ids:
        body["return_token_ids"] = True
    body.update(opts.extra_body)
    return path, body


def _chunk_text(choice: dict[str, Any]) -> str:
    if "delta" in choice:
        return (choice["delta"] or {}).get("content") or ""
    return choice.get("text") or ""


async def send(http: aiohttp.ClientSession, base_url: str, session: Session, turn: Turn, opts: RequestOptions,
               run_start: float) -> RequestRecord:
    """Send one turn and read its stream to the end; failures are recorded, never raised."""
    path, body = build_body(session, turn, opts)
    t0 = time.perf_counter()
    return await stream(http, base_url + path, body, RequestRecord(session.id, session.next_turn, t0 - run_start), t0)


async def stream(http: aiohttp.ClientSession, url: str, body: dict[str, Any], rec: RequestRecord | None = None,
                 t0: float | None = None, headers: dict[str, str] | None = None,
                 on_tokens: Callable[[int], None] | None = None) -> RequestRecord:
    """POST a streaming `body` to `url` and read its SSE to the end, timing every chunk with output from t0
    (default: now); failures are recorded, never raised. `on_tokens(n)` is told of each chunk's n tokens."""
    t0 = time.perf_counter() if t0 is None else t0
    rec = rec or RequestRecord("", 0, 0.0)
    last = t0
    answer: list[str] = []
    streamed = 0
    try:
        async with http.post(url, json=body, headers=headers) as resp:
            rec.status = resp.status
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return rec
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[5:])
                now = time.perf_counter()
                if event.get("error"):
                    rec.error = f"stream error: {json.dumps(event['error'])[:300]}"
                    return rec
                usage = event.get("usage")
                if usage:
                    rec.prompt_tokens = usage.get("prompt_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    rec.cached_tokens = details.get("cached_tokens")
                    if usage.get("completion_tokens") is not None:
                        rec.completion_tokens = int(usage["completion_tokens"])
                for choice in event.get("choices") or []:
                    text = _chunk_text(choice)
                    ids = choice.get("token_ids")
                    n = len(ids) if ids is not None else (1 if text else 0)
                    answer.append(text)
                    rec.finish_reason = choice.get("finish_reason") or rec.finish_reason
                    if n == 0:
                        continue
                    streamed += n
                    rec.token_ids += ids or []
                    if rec.ttft is None:  # tokens arriving with the first one have no gap before them
                        rec.ttft = now - t0
                        rec.itl += [0.0] * (n - 1)
                    else:
                        rec.itl += [(now - last) / n] * n
                        rec.chunk_gaps.append(now - last)
                    last = now
                    if on_tokens is not None:
                        on_tokens(n)
            rec.e2e = time.perf_counter() - t0
            rec.output_tokens = streamed if rec.completion_tokens is None else rec.completion_tokens
            rec.ok = rec.ttft is not None
            if not rec.ok:
                rec.error = "stream ended without any output token"
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}"[:300]
    finally:
        rec.answer = "".join(answer)
    return rec
