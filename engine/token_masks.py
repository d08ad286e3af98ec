"""Tokens a request may not sample next: vLLM's bad_words and allowed_token_ids.

`bad_words` are strings; the engine tokenizes each once (`bad_words_token_ids`, vLLM's rule: the
word as written and with a leading space, when that spelling is a different token sequence of the
same length) and a word's last token is banned whenever the output so far ends with the word's
other tokens. `allowed_token_ids` bans every token outside the list. Both change the argmax, so
greedy requests see them; logprobs stay those of the raw logits.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def bad_words_token_ids(tokenizer: Any, words: list[str], vocab_size: int) -> list[list[int]]:
    """The token sequences `words` forbid (ValueError for a word that tokenizes outside the vocabulary)."""
    out: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        out.append(plain)
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    bad = [t for ids in out for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"bad_words tokenize to token id {bad[0]}, outside the vocabulary [0, {vocab_size})")
    return [ids for ids in out if ids]


def banned_tokens(sequences: list[list[int]], output: list[int]) -> set[int]:
    """Last tokens of the bad-word sequences whose other tokens end `output`."""
    banned = set()
    for ids in sequences:
        prefix = ids[:-1]
        if len(prefix) <= len(output) and (not prefix or output[-len(prefix):] == prefix):
            banned.add(ids[-1])
    return banned


def apply_token_masks(logits: torch.Tensor, requests: Sequence[Any]) -> None:
    """Bad words and allowed_token_ids of each row, in place (-inf on every banned token)."""
    rows, cols = [], []
    for i, r in enumerate(requests):
        params = r.sampling_params
        if params.bad_words_token_ids:
            for t in banned_tokens(params.bad_words_token_ids, r.output_token_ids):
                rows.append(i)
                cols.append(t)
        if params.allowed_token_ids:
            keep = torch.zeros(logits.shape[1], dtype=torch.bool, device=logits.device)
            keep[torch.tensor(params.allowed_token_ids, dtype=torch.long).to(logits.device)] = True
            logits[i].masked_fill_(~keep, float("-inf"))
    if rows:
        index = tuple(torch.tensor(x, dtype=torch.long).to(logits.device) for x in (rows, cols))
        logits.index_put_(index, torch.tensor(float("-inf"), device=logits.device))


def has_token_masks(request: Any) -> bool:
    params = request.sampling_params
    return bool(params.bad_words_token_ids or params.allowed_token_ids)
