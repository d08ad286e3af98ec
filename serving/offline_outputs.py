"""The offline API's results in vLLM's shape: RequestOutput per prompt, CompletionOutput per choice.

The engine reports each choice separately, step by step (engine/outputs.py: deltas while it
runs, the whole output once it finishes). `LLM.generate` gathers those into what vLLM users
read: `outputs[i]` is choice i of the prompt's n, with the per-token logprobs accumulated over
the steps (only when the request asked for logprobs, as in vLLM).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.outputs import Logprob
from pdserve.engine.outputs import StepOutput


@dataclass
class CompletionOutput:
    """One choice of a finished prompt (vLLM's CompletionOutput)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # sum of the sampled tokens' logprobs; None unless logprobs were asked
    # Per output token: {token id: Logprob} with the sampled token and the top_logprobs most likely ones.
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that matched

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One prompt's finished result (vLLM's RequestOutput): its choices in `outputs`.

    `text`, `token_ids`, `finish_reason` and `stop_reason` are choice 0's, for callers of the
    flat result pdserve's offline API returned before it took vLLM's shape."""

    request_id: str
    prompt: str | None  # the prompt text (None for a prompt given as token ids)
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int  # prompt tokens from the prefix cache or the KV store

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> int | str | None:
        return self.outputs[0].stop_reason


@dataclass
class _Choice:
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    final: StepOutput | None = None


class ChoiceRecorder:
    """Collects one request's step outputs (all n choices) into its RequestOutput."""

    def __init__(self, n: int, tokenizer: Any) -> None:
        self.choices = [_Choice() for _ in range(n)]
        self.tokenizer = tokenizer
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def done(self) -> bool:
        return all(c.final is not None for c in self.choices)

    def add(self, out: StepOutput) -> None:
        choice = self.choices[out.index]
        tops = out.new_top_logprobs or [[] for _ in out.new_logprobs]
        for token, logprob, top in zip(out.new_token_ids, out.new_logprobs, tops):
            choice.logprobs.append(self._position(token, logprob, top))
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            choice.final = out

    def _position(self, token: int, logprob: float, top: list[tuple[int, float]]) -> dict[int, Logprob]:
        ranks = {t: r for r, (t, _) in enumerate(top, start=1)}
        entry = {token: Logprob(logprob, ranks.get(token), self.tokenizer.decode([token]))}
        for t, lp in top:
            entry.setdefault(t, Logprob(lp, ranks[t], self.tokenizer.decode([t])))
        return entry

    def result(self, request_id: str, prompt: str | None) -> RequestOutput:
        finals = [c.final for c in self.choices]
        assert all(f is not None for f in finals), "result() before every choice finished"
        outputs = []
        for i, (choice, final) in enumerate(zip(self.choices, finals)):
            sampled = [next(iter(position.values())).logprob for position in choice.logprobs]  # inserted first
            outputs.append(CompletionOutput(
                index=i, text=final.text, token_ids=list(final.token_ids),
                cumulative_logprob=sum(sampled) if sampled else None, logprobs=choice.logprobs or None,
                finish_reason=final.finish_reason, stop_reason=final.stop_reason))
        first = finals[0]
        return RequestOutput(request_id=request_id, prompt=prompt, prompt_token_ids=list(first.prompt_token_ids),
                             prompt_logprobs=self.prompt_logprobs or first.prompt_logprobs, outputs=outputs,
                             finished=True, num_cached_tokens=max(f.num_cached_tokens for f in finals))
