"""Token sampling: greedy, temperature, min-p, top-k, top-p, per-request seeds; logprobs of the chosen and top tokens.

Grammar masks, min_tokens, logit_bias and penalties are applied first (engine.logits_processors);
logprobs are always those of the raw logits. Everything runs on the logits' device; the sampled
ids (with the chosen logprobs, only when a request asked) come back to the host in one transfer,
the step's only device->host sync.
"""
from __future__ import annotations

import struct
from collections.abc import Sequence

import torch

from pdserve.common.hashing import digest
from pdserve.engine.logits_processors import process_logits
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SEED_MAX, SEED_MIN


def seeded_generator(seed: int, token_index: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator for token `token_index` of a request with `seed`.

    Derived from (seed, index) alone rather than kept as state, so the n-th token of a seeded
    request is the same whatever it was batched with, after a preemption, or after a step
    whose result was thrown away (a failed KV load).
    """
    if not SEED_MIN <= seed <= SEED_MAX:  # struct would raise a less clear error
        raise ValueError(f"seed must be a 64-bit signed integer, got {seed}")
    key = digest(b"pdserve-sample", struct.pack("<qQ", seed, token_index))
    return torch.Generator(device=device).manual_seed(int.from_bytes(key[:8], "little") >> 1)


class Sampler:
    """Samples one token per row of logits; unseeded requests share one engine-seeded generator."""

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    @staticmethod
    def prepare(request: Request) -> None:
        """Run once per request before it joins any batch: builds what `__call__` will build for it,
        so a parameter the sampler cannot use fails this request here and never a step."""
        seed = request.sampling_params.seed
        if seed is not None:
            seeded_generator(seed, request.num_tokens)

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> tuple[list[int], list[float | None]]:
        """logits [num_reqs, vocab] float32 (raw) -> (token ids, logprob of each under the raw logits
        for the requests that asked for logprobs, else None)."""
        raw = logits
        logits = process_logits(logits, requests)
        tokens = logits.argmax(dim=-1)  # greedy rows: exactly argmax, no noise involved
        rows = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        if rows:
            tokens[rows] = self._sample(logits[rows], [requests[i] for i in rows])
        wanted = [r.sampling_params.logprobs for r in requests]
        if not any(wanted):
            return tokens.tolist(), [None] * len(requests)
        chosen = torch.log_softmax(raw, dim=-1).gather(1, tokens[:, None]).squeeze(1)
        # One transfer for both (float64 holds every token id exactly).
        ids, values = torch.stack((tokens.double(), chosen.double())).tolist()
        return [int(t) for t in ids], [v if w else None for v, w in zip(values, wanted)]

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        vocab = logits.shape[1]
        params = [r.sampling_params for r in requests]
        device = logits.device
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        scaled = logits / temperature[:, None]
        if any(p.min_p > 0 for p in params):  # drop tokens below min_p x the top probability (before top-k/top-p)
            min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
            probs = scaled.softmax(dim=-1)
            scaled = scaled.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, float("-inf"))
        # Only rows with top-k or top-p need the vocabulary sorted; the others race in token order.
        ranked = [i for i, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0]
        if not ranked:
            return self._race(scaled.softmax(dim=-1), requests)
        plain = [i for i in range(len(params)) if i not in set(ranked)]
        tokens = torch.empty(len(params), dtype=torch.long, device=device)
        if plain:
            tokens[plain] = self._race(scaled[plain].softmax(dim=-1), [requests[i] for i in plain])
        probs, order = self._top_k_top_p(scaled[ranked], [params[i] for i in ranked])
        choice = self._race(probs, [requests[i] for i in ranked])
        tokens[ranked] = order.gather(1, choice[:, None]).squeeze(1)
        return tokens

    @staticmethod
    def _top_k_top_p(scaled: torch.Tensor, params: list) -> tuple[torch.Tensor, torch.Tensor]:
        """Probabilities in descending order with the tokens outside top-k / top-p zeroed, and that order."""
        vocab, device = scaled.shape[1], scaled.device
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=device)
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
        sorted_logits.masked_fill_(ranks[None, :] >= top_k[:, None], float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        # Drop a token when the tokens ranked above it already hold top_p of the mass (the first always stays).
        outside = (probs.cumsum(dim=-1) - probs >= top_p[:, None]) & (top_p[:, None] < 1.0)
        return probs.masked_fill_(outside, 0.0), order

    def _race(self, probs: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Exponential race: argmax(p / E) with E ~ Exp(1) draws index i with probability p_i / sum(p).
        Seeded requests draw their row's noise from their own (seed, position) generator."""
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, req in enumerate(requests):
            seed = req.sampling_params.seed
            if seed is not None:
                noise[row].exponential_(generator=seeded_generator(seed, req.num_tokens, probs.device))
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def top_logprobs(logits: torch.Tensor, requests: Sequence[Request]) -> dict[int, list[tuple[int, float]]]:
        """Row -> the `top_logprobs` most likely (token id, logprob) under the raw logits, best first
        (a beam's: its search's candidates, engine/beam_search.py; with logprob_token_ids: those tokens').

        Only rows that asked are computed, so the common path pays nothing.
        """
        chosen = {i: r.sampling_params.logprob_token_ids for i, r in enumerate(requests)
                  if r.sampling_params.logprob_token_ids}
        wanted = [r.beam.num_candidates if r.beam is not None else r.sampling_params.top_logprobs for r in requests]
        rows = [i for i, k in enumerate(wanted) if k > 0 or i in chosen]
        if not rows:
            return {}
        logprobs = torch.log_softmax(logits[rows], dim=-1)
        out = {}
        k = min(max(wanted[i] for i in rows), logits.shape[1])
        if k:
            values, ids = (v.tolist() for v in logprobs.topk(k, dim=-1))
            out = {row: list(zip(ids[j][:wanted[row]], values[j][:wanted[row]])) for j, row in enumerate(rows)}
        for j, row in enumerate(rows):  # vLLM's logprob_token_ids: these tokens instead of the most likely
            if row in chosen:
                out[row] = list(zip(chosen[row], logprobs[j, chosen[row]].tolist()))
        return out
