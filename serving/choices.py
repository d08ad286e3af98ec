"""Many choices, one response: batched prompts x n, numbered and interleaved as OpenAI does.

A completions request with P prompts and n choices per prompt is answered with P x n choices;
choice `i` of prompt `p` has index `p * n + i`. pd-serve runs one engine request per prompt
(the engine forks its n choices), pd-proxy one Prefill + Generate per prompt; both merge the
per-prompt streams with `merge` into ChoiceOutputs, and one `Assembler` per response numbers
them, puts the echoed prompt and vLLM's prompt_logprobs before each choice's first output, and
(for non-streamed answers) collects whole choices and the usage.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pdserve.serving.protocol import CHAT, GenerationRequest
from pdserve.serving.responses import Delta, PromptPosition, echo_delta, prompt_logprobs_json, usage_dict

T = TypeVar("T")
_DONE = object()


async def merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """(stream position, item) from every stream as items arrive. The first error ends the merge;
    leaving early (or an error) cancels and closes every stream."""
    if len(streams) == 1:  # the common case: no tasks, no queue
        async with contextlib.aclosing(streams[0]) as only:
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(k: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((k, item, None))
        except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
            await queue.put((k, _DONE, e))
            return
        await queue.put((k, _DONE, None))

    tasks = [asyncio.create_task(pump(k, s)) for k, s in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            k, item, error = await queue.get()
            if item is _DONE:
                if error is not None and not isinstance(error, asyncio.CancelledError):
                    raise error
                open_streams -= 1
                continue
            yield k, item
    finally:
        for task in tasks:
            task.cancel()
        for task, stream in zip(tasks, streams):
            with contextlib.suppress(BaseException):
                await task
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(BaseException):
                    await aclose()


def sub_request_id(request_id: str, prompt_index: int, num_prompts: int) -> str:
    """The engine / node request id of one prompt of a batch (the request id itself for one prompt)."""
    return request_id if num_prompts == 1 else f"{request_id}-{prompt_index}"


def prompt_positions(prompt_ids: list[int], prompt_logprobs: list[dict[int, Any] | None] | None,
                     decode: Callable[[list[int]], str]) -> list[PromptPosition] | None:
    """The engine's prompt_logprobs (vLLM's list of {token id: Logprob}) as protocol PromptPositions."""
    if prompt_logprobs is None:
        return None
    positions: list[PromptPosition] = [[(prompt_ids[0], None, None, decode([prompt_ids[0]]))]]
    for token, entry in zip(prompt_ids[1:], prompt_logprobs[1:]):
        own = entry[token]
        positions.append([(token, own.logprob, own.rank, own.decoded_token)] +
                         [(t, lp.logprob, lp.rank, lp.decoded_token) for t, lp in entry.items() if t != token])
    return positions


def first_delta(req: GenerationRequest, d: Delta, prompt_text: Callable[[], str],
                positions: Callable[[], list[PromptPosition] | None],
                prompt_token_ids: list[int] | None = None) -> Delta:
    """A choice's first delta with what comes before its output: the echoed prompt (completions:
    the prompt text, and with logprobs its token logprobs; chat: vLLM's echo of the last message
    when the answer continues its role), vLLM's prompt_logprobs and the prompt's token ids."""
    wanted = req.prompt_logprobs is not None or (req.echo and req.logprobs and req.kind != CHAT)
    prompt = positions() if wanted else None
    if req.echo:
        if req.kind == CHAT:
            last = req.messages[-1] if req.messages else None
            if last is not None and last["role"] == req.chat_template.response_role(req.messages):
                d = Delta(last["content"], tokens=[] if d.tokens is not None else None) + d
        else:
            d = echo_delta(prompt_text(), prompt if req.logprobs else None, req.top_logprobs,
                           req.return_tokens_as_token_ids) + d
    if req.prompt_logprobs is not None and prompt is not None:
        d.prompt_logprobs = prompt_logprobs_json(prompt, req.prompt_logprobs)
    if req.return_token_ids:
        d.prompt_token_ids = prompt_token_ids
    return d


@dataclass
class ChoiceOutput:
    """New output of one choice of one prompt, however it arrived (engine or decode node)."""

    prompt_index: int
    delta: Delta  # its index is the choice's index among its prompt's n
    prompt_text: Callable[[], str]  # for echo (asked for only then)
    positions: Callable[[], list[PromptPosition] | None]  # the prompt's logprobs (asked for with the first output)
    usage: dict[str, Any] | None = None  # the choice's usage (responses.usage_dict), once it finished
    prompt_tokens: tuple[int, int] | None = None  # (prompt tokens, cached) when known before the finish
    prompt_token_ids: list[int] | None = None  # known on the first output (return_token_ids reports them)


class Assembler:
    """Numbers and completes the deltas of every choice of one response; collects whole choices."""

    def __init__(self, req: GenerationRequest, num_prompts: int) -> None:
        self.req = req
        self.num_choices = num_prompts * req.n
        self._choices: dict[int, Delta] = {}
        self._started: set[int] = set()
        self._prompts: dict[int, tuple[int, int]] = {}  # prompt index -> (prompt tokens, cached tokens)
        self._completion_tokens: dict[int, int] = {}  # finished choice -> its tokens
        self._sent_tokens: dict[int, int] = {}  # choice -> output tokens seen so far (a stream cut short)
        self.finish_reason: str | None = None  # the last finished choice's: the request's outcome in logs

    def delta(self, out: ChoiceOutput) -> Delta:
        """The client's view of `out`: OpenAI's choice index, and the echo / prompt logprobs first."""
        d = out.delta
        d.index = out.prompt_index * self.req.n + d.index
        self._sent_tokens[d.index] = self._sent_tokens.get(d.index, 0) + len(d.token_ids)
        if out.prompt_tokens is not None:
            self._prompts.setdefault(out.prompt_index, out.prompt_tokens)
        if d.index not in self._started:
            self._started.add(d.index)
            d = first_delta(self.req, d, out.prompt_text, out.positions, out.prompt_token_ids)
        if d.finish_reason:
            self.finish_reason = d.finish_reason
        if out.usage is not None:  # the final word on its prompt's counts
            self._prompts[out.prompt_index] = (out.usage["prompt_tokens"],
                                               out.usage["prompt_tokens_details"]["cached_tokens"])
            self._completion_tokens[d.index] = out.usage["completion_tokens"]
        return d

    def add(self, out: ChoiceOutput) -> Delta:
        """`delta(out)`, also kept for the whole-response body."""
        d = self.delta(out)
        before = self._choices.get(d.index)
        self._choices[d.index] = d if before is None else before + d
        return d

    @property
    def unfinished(self) -> list[int]:
        return [i for i in range(self.num_choices) if i not in self._completion_tokens]

    def all(self) -> list[Delta]:
        return [self._choices[i] for i in sorted(self._choices)]

    def choice_usage(self, index: int) -> dict[str, Any]:
        """Choice `index`'s usage so far (vLLM's continuous usage stats): its prompt and its output."""
        prompt, cached = self._prompts.get(index // self.req.n, (0, 0))
        return usage_dict(prompt, self._completion_tokens.get(index, self._sent_tokens.get(index, 0)), cached)

    def usage(self) -> dict[str, Any]:
        """Each prompt counted once, every choice's output counted (OpenAI's usage for n > 1); a choice
        cut short (shutdown, a node lost) counts the tokens it sent."""
        completion = {**self._sent_tokens, **self._completion_tokens}
        return usage_dict(sum(p for p, _ in self._prompts.values()), sum(completion.values()),
                          sum(c for _, c in self._prompts.values()))
