"""prompt_logprobs: the log-probability, rank and top alternatives of every prompt token.

The logits at position p predict token p+1, so prompt token j (j >= 1) needs the final hidden
state at position j-1, i.e. the forward pass must run over every prompt position. A prefix-
cache hit or a KV load supplies only keys and values, never those hidden states, which is why
the scheduler computes the whole prompt of such a request (see README, "prompt_logprobs on
P/D"). Chunked prefill is fine: each chunk contributes the positions it computed.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pdserve.engine.outputs import Logprob
from pdserve.engine.request import Request


def compute_prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                            requests: Sequence[Request], starts: Sequence[int], num_new: Sequence[int],
                            query_starts: Sequence[int]) -> dict[str, tuple[int, list]]:
    """request id -> (first prompt token index covered, [(logprob, rank, top list)] per token).

    `starts`, `num_new` and `query_starts` are each batch row's first computed position, token
    count and offset in `hidden`. Positions already recorded (a recompute after preemption) are
    skipped, so each prompt token is reported once.
    """
    hidden_rows: list[int] = []
    targets: list[int] = []
    spans: list[tuple[Request, int, int]] = []  # request, first token index, count
    for b, req in enumerate(requests):
        if not req.needs_prompt_logprobs:
            continue
        first = max(starts[b] + 1, len(req.prompt_logprobs) + 1)  # token index predicted by the first row
        last = min(starts[b] + num_new[b], req.num_prompt_tokens - 1)  # last token index predicted here
        if last < first:
            continue
        spans.append((req, first, last - first + 1))
        hidden_rows.extend(query_starts[b] + (j - 1 - starts[b]) for j in range(first, last + 1))
        targets.extend(req.prompt_token_ids[first:last + 1])
    if not spans:
        return {}
    device = hidden.device
    logprobs = torch.log_softmax(compute_logits(hidden[torch.tensor(hidden_rows, device=device)]).float(), dim=-1)
    target = torch.tensor(targets, device=device)[:, None]
    chosen = logprobs.gather(1, target)
    ranks = (logprobs > chosen).sum(dim=-1) + 1  # 1 = the most likely token (vLLM's rank)
    k = max(req.sampling_params.prompt_logprobs for req, _, _ in spans)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (chosen[:, :0], target[:, :0])
    chosen_l, ranks_l, values_l, ids_l = (t.tolist() for t in (chosen.squeeze(1), ranks, top_values, top_ids))
    out: dict[str, tuple[int, list]] = {}
    row = 0
    for req, first, count in spans:
        n = req.sampling_params.prompt_logprobs
        out[req.request_id] = (first, [(chosen_l[r], ranks_l[r], list(zip(ids_l[r][:n], values_l[r][:n])))
                                       for r in range(row, row + count)])
        row += count
    return out


def prompt_logprobs_output(request: Request, decode: Callable[[list[int]], str]) -> list[dict[int, Logprob] | None]:
    """vLLM's prompt_logprobs for a request whose prompt tokens all have theirs: None for the first token,
    then {token id: Logprob} with the prompt token itself plus the `prompt_logprobs` most likely tokens."""
    out: list[dict[int, Logprob] | None] = [None]
    for token, (logprob, rank, top) in zip(request.prompt_token_ids[1:], request.prompt_logprobs):
        entry = {token: Logprob(logprob, rank, decode([token]))}
        for r, (t, lp) in enumerate(top, 1):
            entry.setdefault(t, Logprob(lp, r, decode([t])))
        out.append(entry)
    return out
