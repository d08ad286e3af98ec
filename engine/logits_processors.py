"""What happens to a batch's logits before a token is picked, in vLLM's order.

    1. structured outputs: tokens the request's grammar forbids -> -inf   (engine.structured_output)
    2. min_tokens: EOS and stop_token_ids -> -inf until min_tokens were generated
    3. bad_words, allowed_token_ids: banned tokens -> -inf                  (engine.token_masks)
    4. logit_bias: add each request's bias to its tokens
    5. penalties: repetition, frequency, presence                           (engine.penalties)

All five change the argmax, so greedy requests see them too. Each step only the rows that ask
pay anything, and each stage is a handful of batched tensor ops on the logits' device. The
caller's tensor is never modified: logprobs are reported under the raw logits (vLLM's default
`raw_logprobs`), so a processed copy is returned when anything applies.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.engine.penalties import apply_penalties
from pdserve.engine.request import Request
from pdserve.engine.structured_output import apply_grammar_bitmask
from pdserve.engine.token_masks import apply_token_masks, has_token_masks


def _index(rows: list[int], cols: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True),
            torch.tensor(cols, dtype=torch.long).to(device, non_blocking=True))


def min_tokens_stop_ids(request: Request) -> list[int]:
    """Token ids that may not end `request` yet (empty once it has min_tokens outputs)."""
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        return []
    ids = list(params.stop_token_ids)
    if request.eos_token_id is not None and not params.ignore_eos:
        ids.append(request.eos_token_id)
    return ids


def apply_min_tokens(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    rows, cols = [], []
    for i, r in enumerate(requests):
        for t in min_tokens_stop_ids(r):
            if t < logits.shape[1]:
                rows.append(i)
                cols.append(t)
    if rows:
        logits.index_put_(_index(rows, cols, logits.device), torch.tensor(float("-inf"), device=logits.device))


def apply_logit_bias(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    rows, cols, values = [], [], []
    for i, r in enumerate(requests):
        for t, b in (r.sampling_params.logit_bias or {}).items():
            rows.append(i)
            cols.append(t)
            values.append(b)
    if rows:
        bias = torch.tensor(values, dtype=logits.dtype).to(logits.device, non_blocking=True)
        logits.index_put_(_index(rows, cols, logits.device), bias, accumulate=True)


def process_logits(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """`logits` [batch, vocab] after grammar masks, min_tokens, token masks, logit_bias and penalties (a copy
    if changed)."""
    grammar = any(r.grammar is not None for r in requests)
    min_tokens = any(r.sampling_params.min_tokens > r.num_output_tokens for r in requests)
    masks = any(has_token_masks(r) for r in requests)
    bias = any(r.sampling_params.logit_bias for r in requests)
    penalised = [i for i, r in enumerate(requests) if r.sampling_params.has_penalties]
    if not (grammar or min_tokens or masks or bias or penalised):
        return logits
    logits = logits.clone()
    if grammar:
        apply_grammar_bitmask(logits, requests)
    if min_tokens:
        apply_min_tokens(logits, requests)
    if masks:
        apply_token_masks(logits, requests)
    if bias:
        apply_logit_bias(logits, requests)
    if penalised:
        reqs = [requests[i] for i in penalised]
        params = [r.sampling_params for r in reqs]
        rows = torch.tensor(penalised, dtype=torch.long).to(logits.device, non_blocking=True)
        logits[rows] = apply_penalties(logits[rows], [r.prompt_token_ids for r in reqs],
                                       [r.output_token_ids for r in reqs], [p.presence_penalty for p in params],
                                       [p.frequency_penalty for p in params], [p.repetition_penalty for p in params])
    return logits
