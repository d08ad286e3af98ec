"""Chat prompts of real text for the throughput benchmarks, as token ids: bench/chat.py's conversations
(a shared system prompt, growing histories) through the served model's own chat template, so the ids are
what a client's /v1/chat/completions request would give the engine."""
from __future__ import annotations

from pathlib import Path

from pdserve.bench.chat import conversation


def chat_prompts(model: str | Path, n: int) -> list[list[int]]:
    """n chat-templated prompts (token ids) for the model directory's tokenizer."""
    from pdserve.engine.tokenizer import apply_chat_template, load_tokenizer

    tok = load_tokenizer(str(model))
    return [apply_chat_template(tok, conversation(k)) for k in range(n)]
