"""Beam search on the engine's own sequences, ranked exactly as HF `generate(num_beams=...)` ranks them.

A request with `use_beam_search` (width `n`) starts as one sequence, its prompt computed once. Every
step each live beam offers its 2 x width most likely next tokens (log-softmax of the raw logits, the
sampler's `top_logprobs`); once every live beam has offered, `BeamSearch.advance` ranks all
offers by accumulated logprob and, as HF's beam search does:

- the best 2 x width candidates are kept; of them, those ending in EOS or at the length limit are
  finished hypotheses if they are among the best `width` (score: accumulated logprob / generated
  length ** length_penalty), and the best `width` others run on;
- it stops when no candidate runs on, or (HF's early_stopping=False heuristic) when `width`
  hypotheses are finished and the best running beam, normalised by the current length, cannot
  beat the worst of them.

Scores are float32 sums, as HF's. The scheduler moves the sequences (`Scheduler.fork_sequence`,
`drop_sequence`): a beam that runs on from a parent shares the parent's full KV blocks and copies its
partial one, like the forked choices of n > 1, so no prompt or output token is computed twice.
The answer is the finished hypotheses, best first, as the request's `width` choices.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pdserve.engine.request import Request
    from pdserve.engine.scheduler import Scheduler


def length_normalized(logprob: float, length: int, length_penalty: float) -> float:
    """logprob / length ** length_penalty (HF's beam score), saturating where the power leaves the float
    range (length_penalty may be anywhere in +-1e6) instead of raising inside an engine step."""
    try:
        denominator = float(length) ** length_penalty
    except OverflowError:
        denominator = math.inf
    if denominator == 0.0:
        return -math.inf if logprob < 0 else 0.0
    return logprob / denominator


@dataclass(frozen=True)
class Hypothesis:
    score: float  # accumulated logprob / generated length ** length_penalty
    token_ids: list[int]  # the output, its last token EOS when it stopped there
    cumulative_logprob: float


@dataclass
class BeamSearch:
    request_id: str  # the engine request id (the caller's)
    width: int
    length_penalty: float
    max_tokens: int  # output tokens at most (max_tokens, and what max_model_len leaves)
    eos_token_id: int | None  # None: EOS does not end a beam (ignore_eos)
    anchor: Request | None = None  # the request the engine added (its id is the caller's)
    live: list[tuple[Request, torch.Tensor]] = field(default_factory=list)  # running beams, float32 scores
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most `width`
    num_generated: int = 0
    done: bool = False
    _offers: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    @property
    def num_candidates(self) -> int:
        return 2 * self.width

    def start(self, request: Request) -> None:
        request.beam, self.anchor = self, request
        self.live = [(request, torch.zeros((), dtype=torch.float32))]

    def offer(self, request: Request, candidates: list[tuple[int, float]]) -> bool:
        """A live beam's next-token candidates (best first); True once every live beam has offered."""
        self._offers[request.request_id] = candidates
        return len(self._offers) == len(self.live)

    def advance(self, scheduler: Scheduler) -> None:
        """Rank every offer, record finished hypotheses, move the beams that run on."""
        offers, self._offers = self._offers, {}
        scores, tokens, parents = [], [], []
        for b, (request, score) in enumerate(self.live):
            for token, logprob in offers[request.request_id]:
                scores.append(score + torch.tensor(logprob, dtype=torch.float32))
                tokens.append(token)
                parents.append(b)
        ranked = torch.stack(scores).topk(min(self.num_candidates, len(scores)))
        length = self.num_generated + 1
        running: list[tuple[int, int, torch.Tensor]] = []  # (parent beam, token, score)
        for rank, (score, j) in enumerate(zip(ranked.values, ranked.indices.tolist())):
            token = tokens[j]
            if token == self.eos_token_id or length >= self.max_tokens:
                if rank < self.width:  # only the best `width` may finish (HF's top_num_beam_mask)
                    beam = self.live[parents[j]][0]
                    self._finish(Hypothesis(length_normalized(float(score), length, self.length_penalty),
                                            [*beam.output_token_ids, token], float(score)))
            elif len(running) < self.width:
                running.append((parents[j], token, score))
        self.num_generated = length
        self._move(scheduler, running)
        best = running[0][2] if running else None
        full = len(self.finished) == self.width
        if best is None or (full and length_normalized(float(best), length, self.length_penalty)
                                 <= self.finished[-1].score):
            self.done = True

    def _finish(self, hypothesis: Hypothesis) -> None:
        self.finished = sorted([*self.finished, hypothesis], key=lambda h: -h.score)[:self.width]

    def _move(self, scheduler: Scheduler, running: list[tuple[int, int, torch.Tensor]]) -> None:
        """Beams that lost are dropped; a parent's best successor continues it in place, the others fork
        from it (before it moves on). The live beams stay in score order."""
        first: dict[int, int] = {}
        for k, (b, _, _) in enumerate(running):
            first.setdefault(b, k)
        for b, (request, _) in enumerate(self.live):
            if b not in first:
                scheduler.drop_sequence(request)
        live: list = [None] * len(running)
        for k, (b, token, score) in enumerate(running):
            if first[b] != k:
                live[k] = (scheduler.fork_sequence(self.live[b][0], f"{self.request_id}-beam{next(self._ids)}",
                                                   token), score)
        for b, k in first.items():
            parent = self.live[b][0]
            parent.append_output_token(running[k][1])
            live[k] = (parent, running[k][2])
        self.live = live

    def drop_all(self, scheduler: Scheduler) -> None:
        for request, _ in self.live:
            scheduler.drop_sequence(request)
        self.live = []

    def results(self) -> list[Hypothesis]:
        """The answer, best first (the running beams' best when the request ended otherwise)."""
        return self.finished
