"""Chat conversations of real text: what a chat service's batch looks like (the one copy of these texts).

Every conversation shares one system prompt (a prefix cache's and a KV store's best case across users) and
carries a history that grows from user to user: conversation k holds the first k % (len(TURNS) + 1)
exchanges, then a new question, so conversation k's prompt begins with conversation k-1's history. Used
by `pd-bench chat` (bench/workloads.py) and by benchmarks/chat_workload.py (the engines side by side).
"""
from __future__ import annotations

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


def conversation(k: int) -> list[dict[str, str]]:
    """The messages of conversation k: the system prompt, k % (len(TURNS) + 1) exchanges, a question."""
    messages = [{"role": "system", "content": SYSTEM}]
    for user, assistant in TURNS[:k % (len(TURNS) + 1)]:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    messages.append({"role": "user", "content": QUESTIONS[k % len(QUESTIONS)]})
    return messages
