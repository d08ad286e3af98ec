"""Prompts the tests build: random token ids of the tiny models' ByT5 byte vocabulary, and what to look for
in their outputs."""
from __future__ import annotations

import random


def random_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 259) for _ in range(n)]  # byte tokens of the ByT5 vocabulary


def adjacent_letters(token_ids: list[int]) -> int:
    """Where two byte tokens of visible ASCII characters follow each other (a two-character word of the ByT5
    vocabulary)."""
    return next(i for i in range(len(token_ids) - 1) if all(36 <= t < 130 for t in token_ids[i:i + 2]))
