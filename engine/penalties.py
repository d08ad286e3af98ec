"""Repetition, frequency and presence penalties, vectorised over the batch (vLLM's formulas).

For each row with prompt tokens P and output tokens O (counts c[t] of token t in O):
    repetition: if t in P or t in O:  logit[t] = logit[t] / r  when logit[t] > 0,  else logit[t] * r
    frequency:  logit[t] -= f * c[t]
    presence:   logit[t] -= p * (c[t] > 0)
applied in that order (vLLM's `apply_penalties`). Frequency and presence look at the output only;
repetition also at the prompt. Token lists become padded index tensors on the logits' device, so
the work is a few scatters and elementwise ops there, with no device-to-host copy.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def _padded(token_lists: Sequence[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    """[rows, longest] token ids, short rows padded with `pad` (an id outside the vocabulary)."""
    width = max(1, max(len(t) for t in token_lists))
    rows = [list(t) + [pad] * (width - len(t)) for t in token_lists]
    return torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)


def token_counts(token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[rows, vocab] occurrence counts of each token id in each row's list."""
    ids = _padded(token_lists, vocab_size, device)
    counts = torch.zeros(len(token_lists), vocab_size + 1, dtype=dtype, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=dtype))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
                    presence: Sequence[float], frequency: Sequence[float],
                    repetition: Sequence[float]) -> torch.Tensor:
    """Penalised copy of `logits` [rows, vocab]; one entry per row in every other argument."""
    rows, vocab = logits.shape
    device = logits.device
    out_counts = token_counts(outputs, vocab, device, logits.dtype)
    in_output = out_counts > 0
    out = logits
    if any(r != 1.0 for r in repetition):
        seen = in_output | (token_counts(prompts, vocab, device, torch.int32) > 0)
        rep = torch.tensor(repetition, dtype=logits.dtype).to(device, non_blocking=True)[:, None]
        rep = torch.where(seen, rep, torch.ones((), dtype=logits.dtype, device=device))
        out = torch.where(out > 0, out / rep, out * rep)
    freq = torch.tensor(frequency, dtype=logits.dtype).to(device, non_blocking=True)[:, None]
    pres = torch.tensor(presence, dtype=logits.dtype).to(device, non_blocking=True)[:, None]
    return out - freq * out_counts - pres * in_output.to(logits.dtype)
