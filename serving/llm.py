"""The offline API: `LLM(model_path, **options).generate(prompts, sampling_params)` and `.chat(messages)`.

Results have vLLM's shape (serving/offline_outputs.py): one RequestOutput per prompt, its n
choices in `outputs`, so `llm.generate(prompts, params)[0].outputs[0].text` works as in vLLM.

Like vLLM's offline API it prints its log lines (engine start-up, KV hits and loads, ...)
without the caller configuring logging; PDSERVE_CONFIGURE_LOGGING=0 turns that off
(engine.logging_setup). It lives in serving, not engine, because it wires a KV connector from
`connectors/` into the engine when `kv_store` or `lmcache_config` is given (the engine itself
never imports connectors).
"""
from __future__ import annotations

import itertools
from typing import Any, Sequence

from pdserve.connectors.factory import create_connector
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.lora.request import LoRARequest
from pdserve.engine.logging_setup import configure_default_logging
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import apply_chat_template, encode_prompt
from pdserve.serving.offline_outputs import ChoiceRecorder, RequestOutput

Prompt = str | Sequence[int]
Messages = list[dict[str, Any]]


def _per_prompt(value: Any, num_prompts: int, name: str) -> list[Any]:
    """One value for every prompt, or a list with one per prompt (sampling_params, lora_request)."""
    if isinstance(value, (list, tuple)):
        if len(value) != num_prompts:
            raise ValueError(f"got {len(value)} {name} for {num_prompts} prompts")
        return list(value)
    return [value] * num_prompts


def _is_token_ids(prompt: Any) -> bool:
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(isinstance(t, int) for t in prompt)


class LLM:
    """Runs a batch of prompts to completion through one LLMEngine (continuous batching inside)."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        configure_default_logging()
        self.engine = LLMEngine.from_kwargs(model, connector_factory=create_connector, **kwargs)
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 cache_salt: str | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in prompt order. A prompt is a string or a list of
        token ids. With n > 1 the prompt's choices are `outputs[0..n-1]`. `lora_request` (one, or one per
        prompt, None for the base model) runs prompts under LoRA adapters (LLM(..., enable_lora=True))."""
        batch = [prompts] if isinstance(prompts, str) or _is_token_ids(prompts) else list(prompts)
        return self._run([self._tokenize(p) for p in batch], sampling_params, cache_salt,
                         [p if isinstance(p, str) else None for p in batch], lora_request)

    def chat(self, messages: Messages | Sequence[Messages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True, cache_salt: str | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate replies to conversations (lists of {"role", "content"} messages) with the
        model's chat template; one conversation or a list of them, answered as `generate` does."""
        if isinstance(messages, (list, tuple)) and messages and isinstance(messages[0], dict):
            conversations = [messages]
        else:
            conversations = list(messages)
        tokenizer = self.engine.tokenizer
        token_ids = [apply_chat_template(tokenizer, list(c), add_generation_prompt) for c in conversations]
        return self._run(token_ids, sampling_params, cache_salt, [tokenizer.decode(ids) for ids in token_ids],
                         lora_request)

    def _run(self, token_ids: list[list[int]], sampling_params: SamplingParams | Sequence[SamplingParams] | None,
             cache_salt: str | None, prompts: list[str | None],
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        params = _per_prompt(SamplingParams() if sampling_params is None else sampling_params, len(token_ids),
                             "sampling_params")
        loras = _per_prompt(lora_request, len(token_ids), "lora_request")
        request_ids = [f"gen-{next(self._ids)}" for _ in token_ids]
        recorders = {rid: ChoiceRecorder(p.n, self.engine.tokenizer) for rid, p in zip(request_ids, params)}
        try:
            for rid, ids, p, lora in zip(request_ids, token_ids, params, loras):
                self.engine.add_request(rid, ids, p, cache_salt=cache_salt, lora_request=lora)
            while not all(r.done for r in recorders.values()):
                if not self.engine.has_unfinished_requests():
                    raise RuntimeError("the engine finished without completing every request (aborted elsewhere?)")
                for out in self.engine.step():
                    recorders[out.request_id].add(out)
        except BaseException:
            self.engine.abort_request(request_ids)
            raise
        return [recorders[rid].result(rid, prompt) for rid, prompt in zip(request_ids, prompts)]

    # vLLM's LLM.add_lora / remove_lora / list_loras, through the engine
    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.engine.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.engine.remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        return self.engine.list_loras()

    def _tokenize(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            return encode_prompt(self.engine.tokenizer, prompt)
        if isinstance(prompt, (list, tuple)):
            return list(prompt)
        raise TypeError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
