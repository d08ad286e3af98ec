"""The one Server-Sent-Events writer of the OpenAI API, used by pd-serve and pd-proxy alike.

Everything that makes an OpenAI stream lives here once: the headers, the chat role chunks that
open a chat stream, the rule for when a delta is worth a chunk, the closing usage chunk of
`stream_options.include_usage` (and vLLM's continuous usage in every chunk), and
`data: [DONE]`. Callers only feed it Deltas.

Pacing: one chunk per delta, i.e. per engine step and choice, as vLLM streams; a step whose token
has no text yet (half of a UTF-8 character, text held back while it may become a stop string)
still gets its chunk, so a client sees tokens at the pace they are made, not a few at a time
(bench clients measure inter-token latency per chunk). Only a client that falls behind (its
connection holds bytes it has not taken yet) gets the deltas that arrive meanwhile merged, one
chunk per choice once it has caught up, as vLLM's output collector merges what its consumer has
not taken.
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
        self._transport: Any = None
        self._held: dict[int, Delta] = {}  # per choice, what a client that fell behind has not been sent
        self.num_merged = 0  # deltas that rode in another's chunk because the client was behind

    async def start(self, request: web.Request, request_id: str, prompt_token_ids: list[int] | None = None) -> None:
        """Send the headers (the status is 200 from here on) and, for chat, each choice's role chunk
        (OpenAI opens every one of the n choices with its own; vLLM puts the prompt's token ids there)."""
        self.response = web.StreamResponse(headers={**SSE_HEADERS, "X-Request-Id": request_id})
        request["sse"] = self.response  # the middleware answers with it when the client goes away
        self._transport = request.transport
        await self.response.prepare(request)
        if self.builder.req.kind == CHAT:
            for index in range(self.builder.req.n):
                role = self.builder.chunk(Delta("", index=index, prompt_token_ids=prompt_token_ids), role=True,
                                          usage=self._usage_of(index, output=False))
                await self._write(role)

    async def delta(self, d: Delta) -> None:
        """A chunk when the delta carries a token, text or a finish reason; held and merged with the next
        ones of its choice while the client is behind."""
        if not (d.token_ids or d.text or d.finish_reason):
            return
        held = self._held.pop(d.index, None)
        if held is not None:
            self.num_merged += 1
            d = held + d
        self._held[d.index] = d
        if not self._behind():
            await self._send_held()

    def _behind(self) -> bool:
        """Whether the client has not taken all that was sent (the kernel's buffers are full)."""
        transport = self._transport
        return transport is not None and not transport.is_closing() and transport.get_write_buffer_size() > 0

    async def _send_held(self) -> None:
        held, self._held = self._held, {}
        for d in held.values():
            await self._write(self.builder.chunk(d, usage=self._usage_of(d.index)))

    async def error(self, err: APIError) -> None:
        """A failure after the stream started: the client learns it in-band, as an error event."""
        await self._send_held()
        await self._write(err.body())

    async def finish(self, usage: dict[str, Any] | None) -> web.StreamResponse:
        """The usage chunk (when asked for and known), `[DONE]`, end of body."""
        assert self.response is not None
        await self._send_held()
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
