"""pd-serve's HTTP application (aiohttp, OpenAI-compatible) and the `pd-serve` console script.

Handlers only translate: protocol.py validates and formats, sse.py streams, errors.py maps
engine exceptions, AsyncLLMEngine generates. The middleware (http.py) gives every request its
id and one log line.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
import sys
import time
from typing import Any, Awaitable, Callable

from aiohttp import web

from engine.async_engine import RequestAbortedError
from engine.tokenizer import apply_chat_template, encode_prompt
from serving import errors
from serving import protocol as oai
from serving.cli import ArgumentParser, add_engine_args, add_server_args, setup_logging
from serving.errors import StartupError
from serving.http import api_middleware, json_response, listen_socket, serve_app
from serving.metrics import CONTENT_TYPE
from serving.sse import SSEStream
from serving.startup import create_async_engine

logger = logging.getLogger(__name__)

_GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")
_TOKENIZE_IN_EXECUTOR_CHARS = 8192  # bigger prompts are tokenized off the event loop


class OpenAIServer:
    """The aiohttp application of one node: OpenAI endpoints plus /health, /stats, /metrics."""

    def __init__(self, async_engine: Any, served_model_names: list[str], metrics: Any) -> None:
        self.async_engine = async_engine
        self.engine = async_engine.engine  # the LLMEngine ("engine" means LLMEngine everywhere)
        self.tokenizer = self.engine.tokenizer
        self.served_names = served_model_names
        self.metrics = metrics
        self.created = int(time.time())
        self.app = web.Application(middlewares=[api_middleware(self._count)], client_max_size=64 * 2**20)
        self.app.add_routes([
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.get("/v1/models", self.models),
            web.get("/health", self.health),
            web.get("/stats", self.stats),
            web.get("/metrics", self.prometheus),
        ])

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len  # owned by LLMEngine: never copied

    def _count(self, request: web.Request, outcome: str) -> None:
        if request.path in _GENERATE_PATHS:
            self.metrics.record_outcome(outcome)

    # ------------------------------------------------------------ generation

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, oai.COMPLETION)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, oai.CHAT)

    def _encode(self, req: oai.GenerationRequest) -> list[int]:
        if req.kind == oai.CHAT:
            try:
                return apply_chat_template(self.tokenizer, req.messages)
            except ValueError as e:
                raise oai.bad_request(str(e), "messages") from None
        if isinstance(req.prompt, list):
            return req.prompt
        return encode_prompt(self.tokenizer, req.prompt)

    async def prompt_token_ids_of(self, req: oai.GenerationRequest) -> list[int]:
        if req.kind != oai.CHAT and isinstance(req.prompt, list):  # token ids (every P/D decode request)
            return req.prompt
        size = sum(len(m["content"]) for m in req.messages) if req.kind == oai.CHAT else len(req.prompt)
        if size < _TOKENIZE_IN_EXECUTOR_CHARS:
            return self._encode(req)
        return await asyncio.get_running_loop().run_in_executor(None, self._encode, req)

    def output_delta(self, req: oai.GenerationRequest, text: str, token_ids: list[int], logprobs: list[float],
                     tops: list[list[tuple[int, float]]], finish_reason: str | None) -> oai.Delta:
        """New engine output as the protocol's Delta, token texts decoded (HTTP and gRPC alike)."""
        tokens = [self.tokenizer.decode([t]) for t in token_ids] if req.logprobs else None
        return oai.Delta(text=text, token_ids=list(token_ids), logprobs=list(logprobs) if req.logprobs else [],
                         tokens=tokens, top_logprobs=oai.top_token_texts(self.tokenizer.decode, tops),
                         finish_reason=finish_reason)

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        rid = request["request_id"]
        req = oai.parse_request(kind, await request.read())
        model = oai.check_model(req, self.served_names)
        prompt_ids = await self.prompt_token_ids_of(req)
        params = req.sampling_params(len(prompt_ids), self.max_model_len)
        builder = oai.ResponseBuilder(req, rid, model)
        outputs = self.async_engine.generate(rid, prompt_ids, params, req.cache_salt)
        async with contextlib.aclosing(outputs):
            try:
                first = await anext(outputs)
                if req.stream:
                    last, num_output_tokens = await self._stream(request, builder, outputs, first)
                else:
                    last, logprobs, tops = first, list(first.new_logprobs), list(first.new_top_logprobs)
                    async for last in outputs:
                        logprobs += last.new_logprobs
                        tops += last.new_top_logprobs
                    delta = self.output_delta(req, last.text, last.token_ids, logprobs, tops, last.finish_reason)
                    body = builder.response(delta, self.usage(last), prompt_ids)
                    num_output_tokens = len(last.token_ids)
            except Exception as e:  # before a stream started, or a non-streamed request
                err = errors.from_engine_error(e, kind)
                if err is None:
                    raise
                raise err from None
        request["outcome"] = last.finish_reason or "abort"
        request["summary"] = (f", prompt {len(prompt_ids)} tokens (cached {last.num_cached_tokens}), "
                              f"output {num_output_tokens} tokens")
        if req.stream:
            return request["sse"]
        return json_response(body)

    @staticmethod
    def usage(out: Any, num_output_tokens: int | None = None) -> dict[str, Any]:
        """Usage of a final RequestOutput (the whole output rides on it), or of a stream cut short
        (`num_output_tokens` sent so far: running outputs carry only their step's tokens)."""
        n = len(out.token_ids) if num_output_tokens is None else num_output_tokens
        return oai.usage_dict(len(out.prompt_token_ids), n, out.num_cached_tokens)

    async def _stream(self, request: web.Request, builder: oai.ResponseBuilder, outputs: Any,
                      out: Any) -> tuple[Any, int]:
        """Write SSE chunks until the request finishes; returns the last RequestOutput and the
        number of output tokens sent."""
        req = builder.req
        sse = SSEStream(builder)
        await sse.start(request, request["request_id"])
        num_output_tokens = 0
        while True:
            num_output_tokens += len(out.new_token_ids)
            finish = out.finish_reason if out.finished else None
            await sse.delta(self.output_delta(req, out.new_text, out.new_token_ids, out.new_logprobs,
                                              out.new_top_logprobs, finish))
            if out.finished:
                break
            try:
                out = await anext(outputs)
            except RequestAbortedError:  # shutdown or engine failure: end the stream properly
                await sse.delta(oai.Delta("", finish_reason="abort"))
                break
        await sse.finish(self.usage(out, num_output_tokens))
        return out, num_output_tokens

    # ------------------------------------------------------------ other endpoints

    async def models(self, request: web.Request) -> web.Response:
        return json_response(oai.models_list(self.served_names, self.max_model_len, self.created))

    async def health(self, request: web.Request) -> web.Response:
        if not self.async_engine.accepting:
            raise oai.service_unavailable("the server is shutting down", "shutting_down")
        return json_response({"status": "ok", "model": self.served_names[0]})

    async def stats(self, request: web.Request) -> web.Response:
        """Debug view for tests and operators: the engine's counters plus the async engine's queues."""
        a = self.async_engine
        stats = dataclasses.asdict(a.stats)
        stats.update(num_in_flight=a.num_in_flight, num_unstarted=a.num_unstarted,
                     max_waiting_requests=a.max_waiting_requests, accepting=a.accepting,
                     num_steps=a.num_steps, step_running_s=a.step_running_s)
        return json_response(stats)

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


# ---------------------------------------------------------------- process entry points

async def serve(server: OpenAIServer, sock: socket.socket, prog: str, shutdown_timeout: float) -> None:
    """Run until SIGINT/SIGTERM, then drain: new requests get 503 while in-flight ones finish."""
    engine = server.async_engine
    engine.start()

    async def drain() -> None:
        logger.info("%s shutting down: %d requests in flight, up to %.1f s to finish", prog,
                    engine.num_in_flight, shutdown_timeout)
        await engine.shutdown(shutdown_timeout)

    await serve_app(server.app, sock, prog, lambda: f"(model {server.served_names[0]}, max_model_len "
                    f"{server.max_model_len}, {engine.stats.num_total_blocks} KV blocks)", drain, handler_timeout_s=5.0)


def build_parser(prog: str = "pd-serve",
                 description: str = "OpenAI-compatible LLM server (monolithic, no KV transfer)") -> ArgumentParser:
    """Server + engine options; node launchers add their own (e.g. --kv-store) before parsing."""
    parser = ArgumentParser(prog=prog, description=description)
    add_server_args(parser)
    add_engine_args(parser)
    return parser


def run_node(args: argparse.Namespace, prog: str, preflight: Callable[[], None] | None = None,
             run: Callable[[OpenAIServer, socket.socket], Awaitable[None]] | None = None) -> int:
    """Start a node from parsed args and serve until a signal; the exit status.

    `preflight` runs cheap start-up checks before any weights load (raising StartupError);
    `run` replaces plain HTTP serving (P/D nodes serve their gRPC control plane beside it).
    """
    setup_logging(args.log_level)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        if preflight is not None:
            preflight()
        sock = listen_socket(args.host, args.port)
        async_engine, names = create_async_engine(args)
        server = OpenAIServer(async_engine, names, async_engine.metrics)
        if run is None:
            asyncio.run(serve(server, sock, prog, args.shutdown_timeout))
        else:
            asyncio.run(run(server, sock))
    except StartupError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """`pd-serve`: monolithic serving, the baseline every P/D setup is compared against."""
    return run_node(build_parser().parse_args(argv), "pd-serve")


if __name__ == "__main__":
    sys.exit(main())
