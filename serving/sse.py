"""The one Server-Sent-Events writer of the OpenAI API, used by pd-serve and pd-proxy alike.

Everything that makes an OpenAI stream lives here once: the headers, the chat role chunks that
open a chat stream, the rule for when a delta is worth a chunk, the closing usage chunk of
`stream_options.include_usage` (and vLLM's continuous usage in every chunk), and
`data: [DONE]`. Callers only feed it Deltas.
"""
from __future__ import annotations

import json
from typing import Any, Callable

from aiohttp import web

from pdserve.serving.protocol import CHAT, APIError
from pdserve.serving.responses import Delta, ResponseBuilder

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
SSE_DONE = b"data: [DONE]\n\n"


def sse_event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class SSEStream:
    """One request's stream: `start`, then `delta` per engine/node output, then `finish`."""

    def __init__(self, builder: ResponseBuilder, usage_so_far: Callable[[int], dict[str, Any]] | None = None) -> None:
        """`usage_so_far(choice index)`: that choice's usage up to now (Assembler.choice_usage), put in
        every chunk when the client asked for continuous usage stats."""
        self.builder = builder
        self.response: web.StreamResponse | None = None
        self._usage = usage_so_far if builder.req.continuous_usage else None

    async def start(self, request: web.Request, request_id: str, prompt_token_ids: list[int] | None = None) -> None:
        """Send the headers (the status is 200 from here on) and, for chat, each choice's role chunk
        (OpenAI opens every one of the n choices with its own; vLLM puts the prompt's token ids there)."""
        self.response = web.StreamResponse(headers={**SSE_HEADERS, "X-Request-Id": request_id})
        request["sse"] = self.response  # the middleware answers with it when the client goes away
        await self.response.prepare(request)
        if self.builder.req.kind == CHAT:
            for index in range(self.builder.req.n):
                role = self.builder.chunk(Delta("", index=index, prompt_token_ids=prompt_token_ids), role=True,
                                          usage=self._usage_of(index, output=False))
                await self._write(role)

    async def delta(self, d: Delta) -> None:
        """A chunk when the delta carries text, a finish reason, or token ids the client asked for."""
        req = self.builder.req
        if d.text or d.finish_reason or (d.token_ids and (req.logprobs or req.return_token_ids or self._usage)):
            await self._write(self.builder.chunk(d, usage=self._usage_of(d.index)))

    async def error(self, err: APIError) -> None:
        """A failure after the stream started: the client learns it in-band, as an error event."""
        await self._write(err.body())

    async def finish(self, usage: dict[str, Any] | None) -> web.StreamResponse:
        """The usage chunk (when asked for and known), `[DONE]`, end of body."""
        assert self.response is not None
        if usage is not None and self.builder.req.include_usage:
            await self._write(self.builder.usage_chunk(usage))
        await self.response.write(SSE_DONE)
        await self.response.write_eof()
        return self.response

    def _usage_of(self, index: int, output: bool = True) -> dict[str, Any] | None:
        """Choice `index`'s usage so far; `output=False`: before any of its output (a role chunk)."""
        if self._usage is None:
            return None
        usage = self._usage(index)
        return usage if output else {**usage, "completion_tokens": 0, "total_tokens": usage["prompt_tokens"]}

    async def _write(self, obj: dict[str, Any]) -> None:
        assert self.response is not None
        await self.response.write(sse_event(obj))
