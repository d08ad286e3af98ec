"""Request traces for benchmarks/fleet_sim.py: arrival processes and prompt shapes with shared prefixes.

A prompt is a list of segments (base, length): the token ids base, base+1, ..., base+length-1 each. Two prompts
share a prefix exactly when they share their leading segments (a system prompt, a document, a conversation's
earlier turns), so a trace of thousands of 2k-token prompts costs a few tuples each; `ids()` expands one at
routing time (outside the timed call, as the proxy has them from the request body).

Arrivals: `poisson` (exponential gaps) or `bursty` (on/off: 5 s mean periods at 1.8x and 0.2x the mean rate, the
same mean). Shapes:
  chat     multi-round chat: sessions start by the arrival process, each takes 3-8 turns 2-20 s apart; turn k's
           prompt is one of 8 shared system prompts (512 tokens) + every earlier turn (user 64-256 tokens, the
           answer 64-256) + the new user message, so each prompt extends the session's previous one.
  docqa    long-document QA: questions arrive by the arrival process, each on one of max(4, fleet/2) documents
           (1.5k-3k tokens, Zipf 1.1 popularity) + a 32-64-token question, answers 32-128 tokens.
  shift    a mix that shifts halfway: long unique prompts (1.5k-2.5k tokens) with short answers (16-64), then short
           prompts (64-256) with long answers (256-768); the rates are set per phase by the caller.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Iterator

_WARM_S = 120.0  # chat sessions start this long before the trace so that it opens mid-conversation
Segments = tuple[tuple[int, int], ...]


@dataclass
class TraceRequest:
    rid: int
    t: float  # arrival, seconds from the trace's start
    segments: Segments
    output: int  # tokens to generate
    prompt_len: int = field(init=False)

    def __post_init__(self) -> None:
        self.prompt_len = sum(n for _, n in self.segments)

    def ids(self) -> list[int]:
        out: list[int] = []
        for base, n in self.segments:
            out.extend(range(base, base + n))
        return out


class _Bases:
    """Fresh token-id ranges: every segment of new text gets ids no other segment uses."""

    def __init__(self) -> None:
        self.next = 1000

    def take(self, n: int) -> tuple[int, int]:
        seg = (self.next, n)
        self.next += n + 7
        return seg


def arrivals(kind: str, rate: float, duration: float, rng: random.Random) -> Iterator[float]:
    """Arrival times in [0, duration) at mean `rate` per second."""
    if kind == "poisson":
        t = rng.expovariate(rate)
        while t < duration:
            yield t
            t += rng.expovariate(rate)
        return
    if kind != "bursty":
        raise ValueError(f"arrivals: poisson or bursty, got {kind!r}")
    t, on = 0.0, True
    while t < duration:
        end = min(duration, t + rng.expovariate(1 / 5.0))
        r = rate * (1.8 if on else 0.2)
        t += rng.expovariate(r)
        while t < end:
            yield t
            t += rng.expovariate(r)
        t, on = end, not on


def chat(arrival: str, rate: float, duration: float, seed: int = 0) -> list[TraceRequest]:
    """Multi-round chat at about `rate` requests/s (sessions start at rate / 5.5, the mean turns per session, from
    _WARM_S before the trace's start: the turns before 0 are not sent but make the later prompts longer)."""
    rng, bases = random.Random(seed), _Bases()
    systems = [bases.take(512) for _ in range(8)]
    out: list[TraceRequest] = []
    for start in arrivals(arrival, rate / 5.5, duration + _WARM_S, rng):
        history: list[tuple[int, int]] = [rng.choice(systems)]
        t = start - _WARM_S  # sessions already under way at 0: the trace starts in the steady state
        for _ in range(rng.randint(3, 8)):
            if t >= duration:
                break
            history.append(bases.take(rng.randint(64, 256)))
            answer = rng.randint(64, 256)
            if t >= 0:
                out.append(TraceRequest(0, t, tuple(history), answer))
            history.append(bases.take(answer))
            t += rng.uniform(2.0, 20.0)
    return _numbered(out)


def docqa(arrival: str, rate: float, duration: float, n_docs: int, seed: int = 0) -> list[TraceRequest]:
    rng, bases = random.Random(seed), _Bases()
    docs = [bases.take(rng.randint(1536, 3072)) for _ in range(n_docs)]
    weights = [1 / (i + 1) ** 1.1 for i in range(n_docs)]
    out = [TraceRequest(0, t, (rng.choices(docs, weights)[0], bases.take(rng.randint(32, 64))), rng.randint(32, 128))
           for t in arrivals(arrival, rate, duration, rng)]
    return _numbered(out)


def shift(arrival: str, rate_long: float, rate_short: float, duration: float, seed: int = 0) -> list[TraceRequest]:
    """Long prompts / short answers for the first half at `rate_long`, then short prompts / long answers."""
    rng, bases = random.Random(seed), _Bases()
    half = duration / 2
    out = [TraceRequest(0, t, (bases.take(rng.randint(1536, 2560)),), rng.randint(16, 64))
           for t in arrivals(arrival, rate_long, half, rng)]
    out += [TraceRequest(0, half + t, (bases.take(rng.randint(64, 256)),), rng.randint(256, 768))
            for t in arrivals(arrival, rate_short, half, rng)]
    return _numbered(out)


def _numbered(reqs: list[TraceRequest]) -> list[TraceRequest]:
    reqs.sort(key=lambda r: r.t)
    for i, r in enumerate(reqs):
        r.rid = i
    return reqs
