"""The offline API: `LLM(model_path, **options).generate(prompts, sampling_params)`."""
from __future__ import annotations

import itertools
from typing import Any, Sequence

from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.tokenizer import encode_prompt

Prompt = str | Sequence[int]


def _is_token_ids(prompt: Any) -> bool:
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(isinstance(t, int) for t in prompt)


class LLM:
    """Runs a batch of prompts to completion through one LLMEngine (continuous batching inside)."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        self.engine = LLMEngine.from_kwargs(model, **kwargs)
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 cache_salt: str | None = None) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in order. A prompt is a string or a list of token ids."""
        batch = [prompts] if isinstance(prompts, str) or _is_token_ids(prompts) else list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(batch):
                raise ValueError(f"got {len(sampling_params)} sampling_params for {len(batch)} prompts")
            params = list(sampling_params)
        else:
            params = [sampling_params or SamplingParams()] * len(batch)
        token_ids = [self._tokenize(p) for p in batch]
        request_ids = [f"gen-{next(self._ids)}" for _ in batch]
        try:
            for rid, ids, p in zip(request_ids, token_ids, params):
                self.engine.add_request(rid, ids, p, cache_salt=cache_salt)
            results: dict[str, RequestOutput] = {}
            while len(results) < len(batch):
                if not self.engine.has_unfinished_requests():
                    raise RuntimeError("the engine finished without completing every request (aborted elsewhere?)")
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
        except BaseException:
            self.engine.abort_request(request_ids)
            raise
        return [results[rid] for rid in request_ids]

    def _tokenize(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            return encode_prompt(self.engine.tokenizer, prompt)
        if isinstance(prompt, (list, tuple)):
            return list(prompt)
        raise TypeError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
