"""The workloads: sessions of turns, each turn one request whose prompt may carry the history so far.

A session is a conversation sent one turn after another (a turn waits for the previous
answer, which becomes part of its prompt); single-request workloads are sessions of one
turn. Lengths are in the served model's tokens: the tokenizer is the model's own
(`--tokenizer`) or the server's /tokenize (bench/server_tokenizer.py), never a guess.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_WORDS = (
    "the of and to in is was for on are with as by at be this from or have an they which one you had not but "
    "what all were when we there can been has more if will who so no out up into do time only would about than "
    "then its two like other could first after any these new some may where most over such know through back "
    "years much before between well work good long great little world still own men same life under never "
    "last while might day place being three year found state system memory cache store token layer model "
    "query answer paper river light market garden signal engine bridge winter number window"
).split()


class TextMaker:
    """Seeded filler text of an exact length in tokens of `tokenizer` (anything with the `encode(text,
    add_special_tokens=False)` and `decode(ids)` of a Hugging Face tokenizer)."""

    def __init__(self, seed: int, tokenizer: Any) -> None:
        self.rng = random.Random(seed)
        self.tokenizer = tokenizer

    def _words(self, num_chars: int) -> str:
        out: list[str] = []
        size = 0
        while size < num_chars:
            word = self.rng.choice(_WORDS)
            out.append(word)
            size += len(word) + 1
        return " ".join(out)

    def text(self, num_tokens: int) -> str:
        if num_tokens <= 0:
            return ""
        ids: list[int] = []
        budget = num_tokens * 2
        while len(ids) < num_tokens:  # words are at least one token each: overshoot, then cut exactly
            ids = self.tokenizer.encode(self._words(budget), add_special_tokens=False)
            budget *= 2
        return self.tokenizer.decode(ids[:num_tokens])

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))


@dataclass
class Turn:
    """One request. Exactly one of text (a user message), token_ids or messages (a whole chat)."""

    max_tokens: int
    text: str | None = None
    token_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None
    arrival_s: float | None = None  # replay traces: seconds after the run starts


@dataclass
class Session:
    """A conversation; with `multi_turn` each turn's prompt holds every earlier question and answer."""

    id: str
    turns: list[Turn]
    system: str | None = None  # the system prompt (shared by every session in multi-round QA)
    context: str | None = None  # put before the first user message: a user's profile, a document
    multi_turn: bool = False
    history: list[dict[str, str]] = field(default_factory=list)
    next_turn: int = 0

    def messages(self, turn: Turn) -> list[dict[str, str]]:
        """The chat messages of `turn` given the history so far."""
        if turn.messages is not None:
            return turn.messages
        text = turn.text or ""
        if self.context and not self.history:
            text = f"{self.context}\n\n{text}" if text else self.context
        system = [{"role": "system", "content": self.system}] if self.system else []
        return [*system, *self.history, {"role": "user", "content": text}]

    def record_answer(self, turn: Turn, answer: str) -> None:
        if self.multi_turn:
            self.history = self.messages(turn)[1 if self.system else 0:] + [{"role": "assistant",
                                                                                 "content": answer}]


def render_text(messages: list[dict[str, str]]) -> str:
    """A chat as one completions prompt: the bare text for a lone user message, else role-tagged turns."""
    if len(messages) == 1 and messages[0]["role"] == "user":
        return messages[0]["content"]
    return "\n\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\n\nassistant:"


@dataclass
class Workload:
    name: str
    params: dict[str, Any]
    sessions: list[Session]

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    @property
    def timed(self) -> bool:
        """Whether the trace itself says when each request starts."""
        return any(t.arrival_s is not None for s in self.sessions for t in s.turns)


def multi_round_qa(maker: TextMaker, users: int, rounds: int, system_prompt_len: int, user_info_len: int,
                   question_len: int, answer_len: int) -> Workload:
    """LMCache's multi-round QA: one shared system prompt, a profile per user, `rounds` questions each."""
    system = maker.text(system_prompt_len)
    sessions = [Session(f"user{u}", [Turn(answer_len, text=f"Question {r + 1}: " + maker.text(question_len))
                                     for r in range(rounds)],
                        system=system, context=f"About me: {maker.text(user_info_len)}", multi_turn=True)
                for u in range(users)]
    params = dict(users=users, rounds=rounds, system_prompt_len=system_prompt_len, user_info_len=user_info_len,
                  question_len=question_len, answer_len=answer_len)
    return Workload("multi-round-qa", params, sessions)


def chat(num_requests: int, answer_len: int) -> Workload:
    """Conversations of real text (bench/chat.py): one shared system prompt, histories growing from user to
    user, each sent whole as one chat request."""
    from pdserve.bench.chat import conversation

    sessions = [Session(f"chat{k}", [Turn(answer_len, messages=conversation(k))]) for k in range(num_requests)]
    return Workload("chat", dict(num_requests=num_requests, answer_len=answer_len), sessions)


def long_doc_qa(maker: TextMaker, documents: int, doc_len: int, questions: int, question_len: int,
                answer_len: int) -> Workload:
    """D long documents, each asked `questions` questions; all (document, question) pairs in shuffled order."""
    docs = [f"Document {d}: {maker.text(doc_len)}" for d in range(documents)]
    pairs = [(d, q) for d in range(documents) for q in range(questions)]
    maker.rng.shuffle(pairs)
    sessions = [Session(f"doc{d}-q{q}", [Turn(answer_len, text=f"Question {q + 1}: " + maker.text(question_len))],
                        context=docs[d]) for d, q in pairs]
    params = dict(documents=documents, doc_len=doc_len, questions=questions, question_len=question_len,
                  answer_len=answer_len)
    return Workload("long-doc-qa", params, sessions)


def random_lengths(maker: TextMaker, num_requests: int, input_len: int, output_len: int) -> Workload:
    """Independent prompts of fixed input and output lengths (no shared prefix beyond chance)."""
    sessions = [Session(f"req{i}", [Turn(output_len, text=maker.text(input_len))]) for i in range(num_requests)]
    return Workload("random", dict(num_requests=num_requests, input_len=input_len, output_len=output_len), sessions)


class TraceError(ValueError):
    pass


def _sharegpt_turn(conversation: list[dict[str, Any]], maker: TextMaker) -> tuple[str, int | None]:
    """First human message and the length of the reply that followed it (None if none)."""
    texts = [(m.get("from") or m.get("role"), m.get("value") or m.get("content") or "") for m in conversation]
    for i, (role, text) in enumerate(texts):
        if role in ("human", "user"):
            reply = texts[i + 1][1] if i + 1 < len(texts) else None
            return text, (maker.count(reply) if reply else None)
    raise TraceError("conversation has no human/user message")


def _trace_turn(line: dict[str, Any], maker: TextMaker, default_max_tokens: int) -> Turn:
    max_tokens = line.get("max_tokens", line.get("output_len"))
    arrival = line.get("timestamp")
    turn = Turn(0, arrival_s=float(arrival) if arrival is not None else None)
    if "conversations" in line:
        turn.text, reply_len = _sharegpt_turn(line["conversations"], maker)
        max_tokens = max_tokens or reply_len
    elif "messages" in line:
        turn.messages = list(line["messages"])
    elif "prompt_token_ids" in line or isinstance(line.get("prompt"), list):
        turn.token_ids = [int(t) for t in line.get("prompt_token_ids", line.get("prompt"))]
    elif isinstance(line.get("prompt"), str):
        turn.text = line["prompt"]
    elif "input_len" in line or "prompt_len" in line:
        turn.text = maker.text(int(line.get("input_len", line.get("prompt_len"))))
    else:
        raise TraceError("needs one of prompt, prompt_token_ids, messages, conversations, input_len")
    turn.max_tokens = int(max_tokens or default_max_tokens)
    return turn


def replay(path: Path, maker: TextMaker, default_max_tokens: int, limit: int | None = None) -> Workload:
    """A JSONL trace (format in docs: bench/README.md). Lines sharing a `session` are one conversation."""
    sessions: dict[str, Session] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            if limit is not None and sum(len(s.turns) for s in sessions.values()) >= limit:
                break
            try:
                line = json.loads(raw)
                if not isinstance(line, dict):
                    raise TraceError("each line must be a JSON object")
                turn = _trace_turn(line, maker, default_max_tokens)
            except (ValueError, TypeError, KeyError) as e:
                raise TraceError(f"{path}:{lineno}: {e}") from None
            key = str(line.get("session", f"line{lineno}"))
            session = sessions.setdefault(key, Session(key, [], multi_turn="session" in line))
            session.turns.append(turn)
    if not sessions:
        raise TraceError(f"{path}: no requests in the trace")
    starts = [t.arrival_s for s in sessions.values() for t in s.turns if t.arrival_s is not None]
    for s in sessions.values():  # timestamps relative to the first one
        for t in s.turns:
            if t.arrival_s is not None:
                t.arrival_s -= min(starts)
    return Workload("replay", dict(file=str(path), requests=sum(len(s.turns) for s in sessions.values())),
                    list(sessions.values()))
