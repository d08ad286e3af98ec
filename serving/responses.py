"""OpenAI response bodies and stream chunks, built from Deltas (transport-neutral, like serving.protocol).

pd-serve builds Deltas from engine outputs, pd-proxy from a decode node's gRPC deltas; either way
this module alone decides how choices, logprobs (completions' and chat's shapes), echoed prompts,
vLLM's prompt_logprobs and usage look on the wire.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from pdserve.serving.protocol import CHAT, COMPLETION, GenerationRequest


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def models_list(names: list[str], max_model_len: int, created: int,
                adapters: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Lists the first (public) name only: the others are accepted aliases, such as the model's path. LoRA
    adapters follow (serving/lora_modules.py: vLLM's cards, `parent` the base model's name)."""
    cards = [{"id": names[0], "object": "model", "created": created, "owned_by": "pdserve",
              "max_model_len": max_model_len}]
    cards += [{**card, "created": created, "max_model_len": max_model_len} for card in adapters or []]
    return {"object": "list", "data": cards}


@dataclass
class Delta:
    """New output of one choice since the last delta (what the engine or a decode node streams)."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)  # None: an echoed first prompt token
    tokens: list[str] | None = None  # token strings for logprobs; None: not available
    # per token, best first; None: an echoed first prompt token
    top_logprobs: list[list[tuple[str, float]] | None] = field(default_factory=list)
    finish_reason: str | None = None
    index: int = 0  # the choice (prompt index x n + the engine's choice index)
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # vLLM's field, JSON-ready
    prompt_token_ids: list[int] | None = None  # on a choice's first delta, with return_token_ids

    def __add__(self, later: Delta) -> Delta:
        """This delta followed by `later` (an echoed prompt and the output; the chunks of one choice)."""
        tokens = None if self.tokens is None and later.tokens is None else (self.tokens or []) + (later.tokens or [])
        return Delta(self.text + later.text, self.token_ids + later.token_ids, self.logprobs + later.logprobs,
                     tokens, self.top_logprobs + later.top_logprobs, later.finish_reason, later.index,
                     later.prompt_logprobs if later.prompt_logprobs is not None else self.prompt_logprobs,
                     later.prompt_token_ids if later.prompt_token_ids is not None else self.prompt_token_ids)


# One prompt position's logprobs, transport-neutral: (token id, logprob, rank, token text) with the
# prompt token first, then the position's most likely tokens. Position 0 has only the prompt token,
# with logprob and rank None (nothing predicts it).
PromptPosition = list[tuple[int, float | None, int | None, str]]


def prompt_logprobs_json(positions: list[PromptPosition], k: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's prompt_logprobs: null for the first token, then {token id: {logprob, rank, decoded_token}}
    holding the prompt token and the k most likely tokens."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for position in positions[1:]:
        out.append({str(t): {"logprob": lp, "rank": rank, "decoded_token": text}
                    for j, (t, lp, rank, text) in enumerate(position) if j == 0 or (rank or 0) <= k})
    return out


def token_namer(decode: Callable[[list[int]], str], as_token_ids: bool) -> Callable[[int], str]:
    """How a logprobs entry names a token: its text decoded alone, or vLLM's "token_id:N" placeholder
    (return_tokens_as_token_ids: every token identifiable, even one that is not valid UTF-8 alone)."""
    if as_token_ids:
        return lambda t: f"token_id:{t}"
    return lambda t: decode([t])


def echo_delta(text: str, positions: list[PromptPosition] | None, top_logprobs: int,
               as_token_ids: bool = False) -> Delta:
    """The echoed prompt as the start of a completions choice: its text and, when `positions` are
    given (echo with logprobs), its tokens with their logprobs and each position's `top_logprobs`
    most likely tokens, named as the output's are (token_namer)."""
    if positions is None:
        return Delta(text)
    name = (lambda e: f"token_id:{e[0]}") if as_token_ids else (lambda e: e[3])
    tokens = [name(p[0]) for p in positions]
    logprobs = [p[0][1] for p in positions]
    tops: list[list[tuple[str, float]] | None] = [None]
    for position in positions[1:]:
        best = sorted((e for e in position if e[2] is not None and e[2] <= top_logprobs), key=lambda e: e[2])
        tops.append([(name(e), e[1]) for e in best])
    return Delta(text, logprobs=logprobs, tokens=tokens, top_logprobs=tops)


def top_token_texts(name: Callable[[int], str],
                    tops: list[list[tuple[int, float]]]) -> list[list[tuple[str, float]]]:
    """The engine's (token id, logprob) lists with each id named as the sampled tokens are (token_namer)."""
    return [[(name(t), lp) for t, lp in top] for top in tops]


def top_by_text(top: list[tuple[str, float]]) -> dict[str, float]:
    """Completions key top tokens by text: ids that decode alike (partial UTF-8) keep the best logprob."""
    out: dict[str, float] = {}
    for text, logprob in top:
        out.setdefault(text, logprob)
    return out


class ResponseBuilder:
    """Formats one request's answer: SSE chunks while streaming, or the final JSON body."""

    def __init__(self, req: GenerationRequest, request_id: str, model: str, created: int | None = None) -> None:
        self.req = req
        self.id = ("chatcmpl-" if req.kind == CHAT else "cmpl-") + request_id
        self.model = model
        self.created = int(time.time()) if created is None else created
        self._text_offset: dict[int, int] = {}  # completions logprobs: per choice, offset of the next token

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def _logprobs(self, d: Delta) -> dict[str, Any] | None:
        if not self.req.logprobs:
            return None
        tokens = d.tokens if d.tokens is not None else [""] * len(d.logprobs)
        # positions without top tokens (none asked for; an echoed prompt's are there) have an empty list
        tops = list(d.top_logprobs) + [[] for _ in range(len(tokens) - len(d.top_logprobs))]
        if self.req.kind == CHAT:
            # with logprob_token_ids vLLM lists the sampled token first, then the asked-for ones
            chosen = bool(self.req.sampling.get("logprob_token_ids"))
            return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                                 "top_logprobs": [{"token": tt, "logprob": tlp, "bytes": list(tt.encode())}
                                                  for tt, tlp in (top_by_text([(t, lp), *top]).items() if chosen
                                                                  else top)]}
                                for t, lp, top in zip(tokens, d.logprobs, tops)]}
        offsets = []
        offset = self._text_offset.get(d.index, 0)
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        self._text_offset[d.index] = offset
        # vLLM's completions shape: per position the token itself, then the `logprobs` most likely
        # ones (so logprobs=0 still gives one entry); the echoed first prompt token has none.
        return {"tokens": tokens, "token_logprobs": d.logprobs, "text_offset": offsets,
                "top_logprobs": [None if top is None else top_by_text([(t, lp), *top])
                                 for t, lp, top in zip(tokens, d.logprobs, tops)]}

    def _choice(self, d: Delta, *, stream: bool, role: bool = False) -> dict[str, Any]:
        """One choice as vLLM shapes it: a whole response names every field (null when not asked for),
        a stream chunk only those it carries; a chat role chunk has no logprobs."""
        choice: dict[str, Any] = {"index": d.index}
        token_ids = self.req.return_token_ids
        if self.req.kind == CHAT:
            role_name = self.req.chat_template.response_role(self.req.messages)
            message = {"role": role_name, "content": d.text} if (role or not stream) else (
                {"content": d.text} if d.text else {})
            choice["delta" if stream else "message"] = message
        else:
            choice["text"] = d.text
        choice["logprobs"] = None if role else self._logprobs(d)
        choice["finish_reason"] = d.finish_reason
        if not stream or (token_ids and not role):
            choice["token_ids"] = d.token_ids if token_ids else None
        if self.req.kind == COMPLETION and not stream:
            choice["prompt_logprobs"] = d.prompt_logprobs
        if self.req.kind == COMPLETION and (not stream or (token_ids and d.prompt_token_ids is not None)):
            choice["prompt_token_ids"] = d.prompt_token_ids if token_ids else None
        return choice

    def chunk(self, d: Delta, *, role: bool = False, usage: dict[str, Any] | None = None) -> dict[str, Any]:
        """A streaming chunk; `role=True` for a chat stream's first chunk of a choice (with the prompt's
        token ids when asked: vLLM's place for them); `usage` the choice's usage so far (continuous
        usage), else null in every chunk before the usage chunk (include_usage)."""
        obj = "chat.completion.chunk" if self.req.kind == CHAT else "text_completion"
        out = self._envelope(obj, [self._choice(d, stream=True, role=role)])
        if role and self.req.return_token_ids and d.prompt_token_ids is not None:
            out["prompt_token_ids"] = d.prompt_token_ids
        if self.req.include_usage:
            out["usage"] = usage
        return out

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The extra last chunk of `stream_options.include_usage`: no choices, only usage."""
        obj = "chat.completion.chunk" if self.req.kind == CHAT else "text_completion"
        out = self._envelope(obj, [])
        out["usage"] = usage
        return out

    def response(self, choices: Delta | list[Delta], usage: dict[str, Any]) -> dict:
        """The non-streaming body: each choice's whole output, in index order. Completions carry the
        prompt's token ids and logprobs in each choice, chat beside the choices (vLLM's places)."""
        choices = sorted([choices] if isinstance(choices, Delta) else choices, key=lambda d: d.index)
        obj = "chat.completion" if self.req.kind == CHAT else "text_completion"
        out = self._envelope(obj, [self._choice(d, stream=False) for d in choices])
        if self.req.kind == CHAT:
            first = choices[0] if choices else Delta("")
            out["prompt_logprobs"] = first.prompt_logprobs
            out["prompt_token_ids"] = first.prompt_token_ids if self.req.return_token_ids else None
        out["usage"] = usage
        return out
