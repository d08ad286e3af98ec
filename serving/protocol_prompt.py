"""How a prompt becomes token ids beyond the tokenizer itself: vLLM's add_special_tokens and truncation.

`truncate_prompt_tokens` keeps k prompt tokens (-1: as many as fit beside max_tokens), from the end
(`truncation_side` "left", vLLM's default) or the start ("right"); it applies to text, chat and
token-id prompts alike and is idempotent, so a P/D decode node that gets the prefill node's
(already truncated) token ids computes the same prompt.
"""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.serving.protocol_fields import bad_request, int_field, optional_bool

PROMPT_FIELDS = ("add_special_tokens", "truncate_prompt_tokens", "truncation_side")
TRUNCATION_SIDES = ("left", "right")


@dataclass(frozen=True)
class PromptOptions:
    add_special_tokens: bool | None = None  # None: the endpoint's default (completions true, chat false)
    truncate_prompt_tokens: int | None = None  # None: no truncation; -1: max_model_len - max_tokens
    truncation_side: str = "left"  # left keeps the last tokens, right the first

    def truncate(self, token_ids: list[int], max_model_len: int, max_tokens: int | None) -> list[int]:
        """The prompt as the engine gets it; 400 when k exceeds what the context leaves (vLLM's rule)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return token_ids
        room = max_model_len - (max_tokens or 1)  # without max_tokens: room for at least one output token
        if k == -1:
            k = room
        elif k > room:
            raise bad_request(f"truncate_prompt_tokens={k} cannot be greater than max_model_len - max_tokens = "
                              f"{room}. Please request a smaller truncation size.", "truncate_prompt_tokens")
        if len(token_ids) <= k:
            return token_ids
        return token_ids[-k:] if self.truncation_side == "left" else token_ids[:k]


def parse_prompt_options(body: dict) -> PromptOptions:
    k = int_field(body, "truncate_prompt_tokens", None, -1)
    if k == 0:
        raise bad_request("truncate_prompt_tokens must be -1 or a positive integer, got 0", "truncate_prompt_tokens")
    side = body.get("truncation_side")
    if side is not None and side not in TRUNCATION_SIDES:
        raise bad_request(f"truncation_side must be one of {', '.join(TRUNCATION_SIDES)}, got {side!r}",
                          "truncation_side")
    return PromptOptions(optional_bool(body, "add_special_tokens"), k, side or "left")
