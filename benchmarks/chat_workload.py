"""Chat prompts of real text for the throughput benchmarks: what a chat service's batch looks like.

Every conversation shares one system prompt (a prefix cache's best case across users) and carries a history
that grows from user to user: conversation k holds the first k % len(TURNS) exchanges, then a new question.
The text goes through the served model's own chat template, so the token ids are what a client's
/v1/chat/completions request would give the engine.
"""
from __future__ import annotations

from pathlib import Path

SYSTEM = ("You are a helpful assistant for the operators of a large inference cluster. Answer precisely, "
          "name the component you mean, and keep each answer to a few sentences.")
TURNS: list[tuple[str, str]] = [
    ("What does a prefill node do?",
     "It computes the prompt once, saves its KV cache to the shared store, and returns the first token."),
    ("And the decode node?",
     "It loads the saved KV cache instead of recomputing it, then generates the rest of the answer token by token."),
    ("Why split the two?",
     "Prompts are compute-bound and decoding is memory-bound, so each kind of node can be sized for its own work."),
    ("What happens when the store is down?",
     "The decode node recomputes the prompt itself: the answer is the same, it only arrives later."),
    ("How large is the KV cache of one token?",
     "Two tensors per layer, keys and values, each of kv heads times head size elements."),
    ("Which requests benefit most from a prefix cache?",
     "Those that share a long beginning, such as a system prompt or a document several users ask about."),
    ("How do I see whether a request hit the store?",
     "Each node logs one line per request with the hit, the tokens loaded and the time the load took."),
]
QUESTIONS = [
    "Explain chunked prefill in two sentences.", "When should I add a second decode node?",
    "What does time to first token measure?", "Why is greedy decoding deterministic?",
    "How does paged attention avoid fragmentation?", "What limits decode throughput on a CPU?",
    "Why are KV chunks aligned to 256 tokens?", "What is a good first metric to alert on?",
]


def chat_prompts(model: str | Path, n: int) -> list[list[int]]:
    """n chat-templated prompts (token ids) for the model directory's tokenizer."""
    from pdserve.engine.tokenizer import apply_chat_template, load_tokenizer

    tok = load_tokenizer(str(model))
    out = []
    for k in range(n):
        messages = [{"role": "system", "content": SYSTEM}]
        for user, assistant in TURNS[:k % (len(TURNS) + 1)]:
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        messages.append({"role": "user", "content": QUESTIONS[k % len(QUESTIONS)]})
        out.append(apply_chat_template(tok, messages))
    return out
