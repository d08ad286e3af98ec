"""The node HTTP server (aiohttp, OpenAI-compatible) and the `pd-serve` console script.

Handlers only translate: protocol.py validates and formats, AsyncLLMEngine generates. Every
request gets an id (X-Request-Id honoured or generated) that is echoed back and starts every
log line about it.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Awaitable, Callable

from aiohttp import web

from engine.async_engine import AsyncLLMEngine, EngineOverloadedError, EngineShutdownError, RequestAbortedError
from engine.config import EngineConfig
from engine.tokenizer import apply_chat_template, encode_prompt
from serving import protocol as oai
from serving.cli import ArgumentParser, add_engine_args, add_server_args, engine_kwargs_from_args, setup_logging
from serving.metrics import CONTENT_TYPE, EngineMetrics

logger = logging.getLogger(__name__)

_GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")
_TOKENIZE_IN_EXECUTOR_CHARS = 8192  # bigger prompts are tokenized off the event loop
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(obj), status=status, content_type="application/json")


def _error_response(err: oai.APIError) -> web.Response:
    return _json(err.body(), err.status)


class OpenAIServer:
    """The aiohttp application of one node: OpenAI endpoints plus /health, /stats, /metrics."""

    def __init__(self, async_engine: Any, served_model_names: list[str], metrics: Any) -> None:
        self.engine = async_engine
        self.llm = async_engine.engine
        self.tokenizer = self.llm.tokenizer
        self.max_model_len = self.llm.max_model_len
        self.served_names = served_model_names
        self.metrics = metrics
        self.created = int(time.time())
        self.app = web.Application(middlewares=[self._middleware], client_max_size=64 * 2**20)
        self.app.add_routes([
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.get("/v1/models", self.models),
            web.get("/health", self.health),
            web.get("/stats", self.stats),
            web.get("/metrics", self.prometheus),
        ])

    # ------------------------------------------------------------ middleware

    @web.middleware
    async def _middleware(self, request: web.Request, handler) -> web.StreamResponse:
        """Request id, OpenAI-shaped errors for everything (never a traceback), one log line per request."""
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        start = time.monotonic()
        request["outcome"] = None
        response: web.StreamResponse | None = None
        try:
            if not oai.REQUEST_ID_RE.fullmatch(rid):
                rid = uuid.uuid4().hex
                raise oai.bad_request("X-Request-Id must be 1-128 printable ASCII characters without spaces")
            request["request_id"] = rid
            response = await handler(request)
        except oai.APIError as e:
            response = _error_response(e)
            request["outcome"] = "rejected" if e.status == 503 else ("invalid" if e.status < 500 else "error")
            request["summary"] = f", {e.code or e.type}: {e.message}"
        except web.HTTPException as e:  # routing (404/405), body too large (413), ...
            response = _json(oai.error_body(e.reason, "invalid_request_error", None, str(e.status)), e.status)
            request["outcome"] = "invalid"
        except asyncio.CancelledError:
            request["outcome"] = "abort"  # the client went away; the engine request was aborted on the way out
            raise
        except ConnectionResetError:  # same, noticed while writing a stream
            request["outcome"] = "abort"
            response = request.get("sse")
            if response is None:
                raise
        except Exception:
            logger.exception("Reqid: %s, %s %s failed", rid, request.method, request.path)
            request["outcome"] = "error"
            response = _json(oai.error_body("internal server error", "server_error", None, "internal_error"), 500)
        finally:
            if request["outcome"]:
                if request.path in _GENERATE_PATHS:
                    self.metrics.record_outcome(request["outcome"])
                logger.info("Reqid: %s, %s -> %s, outcome %s, %.1f ms%s", rid, request.path,
                            response.status if response is not None else "client gone", request["outcome"],
                            (time.monotonic() - start) * 1e3, request.get("summary", ""))
        if not response.prepared:
            response.headers["X-Request-Id"] = rid
        return response

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

    def _delta(self, req: oai.GenerationRequest, text: str, token_ids: list[int], logprobs: list[float],
               tops: list[list[tuple[int, float]]], finish_reason: str | None) -> oai.Delta:
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
        outputs = self.engine.generate(rid, prompt_ids, params, req.cache_salt)
        async with contextlib.aclosing(outputs):
            try:
                first = await anext(outputs)
                if req.stream:
                    last = await self._stream(request, req, builder, outputs, first)
                else:
                    last, logprobs, tops = first, list(first.new_logprobs), list(first.new_top_logprobs)
                    async for last in outputs:
                        logprobs += last.new_logprobs
                        tops += last.new_top_logprobs
                    delta = self._delta(req, last.text, last.token_ids, logprobs, tops, last.finish_reason)
                    body = builder.response(delta, self._usage(last), prompt_ids)
            except EngineOverloadedError as e:
                raise oai.service_unavailable(str(e), "queue_full") from None
            except EngineShutdownError as e:
                raise oai.service_unavailable(str(e), "shutting_down") from None
            except RequestAbortedError as e:  # before a stream started, or a non-streamed request
                raise oai.service_unavailable(str(e), "aborted") from None
            except ValueError as e:  # the engine refused the prompt
                raise oai.bad_request(str(e), "messages" if kind == oai.CHAT else "prompt") from None
        request["outcome"] = last.finish_reason or "abort"
        request["summary"] = (f", prompt {len(prompt_ids)} tokens (cached {max(0, last.num_cached_tokens)}), "
                              f"output {len(last.token_ids)} tokens")
        if req.stream:
            return request["sse"]
        return _json(body)

    @staticmethod
    def _usage(out: Any) -> dict[str, Any]:
        return oai.usage_dict(len(out.prompt_token_ids), len(out.token_ids), out.num_cached_tokens)

    async def _stream(self, request: web.Request, req: oai.GenerationRequest, builder: oai.ResponseBuilder,
                      outputs: Any, out: Any) -> Any:
        """Write SSE chunks until the request finishes; returns the last RequestOutput."""
        resp = web.StreamResponse(headers={**_SSE_HEADERS, "X-Request-Id": request["request_id"]})
        request["sse"] = resp
        await resp.prepare(request)
        if req.kind == oai.CHAT:
            await resp.write(oai.sse_event(builder.chunk(oai.Delta(""), role=True)))
        while True:
            finish = out.finish_reason if out.finished else None
            delta = self._delta(req, out.new_text, out.new_token_ids, out.new_logprobs, out.new_top_logprobs,
                                finish)
            if delta.text or finish or ((req.logprobs or req.return_token_ids) and delta.token_ids):
                await resp.write(oai.sse_event(builder.chunk(delta)))
            if out.finished:
                break
            try:
                out = await anext(outputs)
            except RequestAbortedError:  # shutdown or engine failure: end the stream properly
                await resp.write(oai.sse_event(builder.chunk(oai.Delta("", finish_reason="abort"))))
                break
        if req.include_usage:
            await resp.write(oai.sse_event(builder.usage_chunk(self._usage(out))))
        await resp.write(oai.SSE_DONE)
        await resp.write_eof()
        return out

    # ------------------------------------------------------------ other endpoints

    async def models(self, request: web.Request) -> web.Response:
        return _json(oai.models_list(self.served_names, self.max_model_len, self.created))

    async def health(self, request: web.Request) -> web.Response:
        if not self.engine.accepting:
            raise oai.service_unavailable("the server is shutting down", "shutting_down")
        return _json({"status": "ok", "model": self.served_names[0]})

    async def stats(self, request: web.Request) -> web.Response:
        """Debug view for tests and operators: the engine's counters plus the async engine's queues."""
        stats = dataclasses.asdict(self.engine.stats)
        stats.update(num_in_flight=self.engine.num_in_flight, num_unstarted=self.engine.num_unstarted,
                     max_waiting_requests=self.engine.max_waiting_requests, accepting=self.engine.accepting,
                     num_steps=self.engine.num_steps, step_running_s=self.engine.step_running_s)
        return _json(stats)

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


# ---------------------------------------------------------------- process entry points

class StartupError(Exception):
    """A one-line reason the server cannot start (bad model directory, engine refused the config)."""


def check_model_dir(path: str | None) -> str:
    """The model directory to load (the built-in tiny model if None); StartupError if unusable."""
    if path is None:
        from engine.builtin_model import default_model_path

        return str(default_model_path())
    p = Path(path)
    if not p.is_dir():
        raise StartupError(f"model directory {path} does not exist or is not a directory")
    if not os.access(p, os.R_OK | os.X_OK) or not os.access(p / "config.json", os.R_OK):
        raise StartupError(f"model directory {path} is not readable or has no config.json")
    return str(p)


def create_async_engine(args: argparse.Namespace) -> tuple[AsyncLLMEngine, list[str]]:
    """Build LLMEngine + AsyncLLMEngine + metrics from parsed args; StartupError on any failure.

    Returns the engine and the model names clients may use (the first one is reported back).
    """
    kwargs = engine_kwargs_from_args(args)
    try:  # option errors first, with their own message, before anything slow happens
        EngineConfig.from_kwargs(args.model or "builtin", **kwargs)
    except (TypeError, ValueError) as e:
        raise StartupError(f"invalid engine option: {e}") from None
    model = check_model_dir(args.model)  # before the heavy imports (torch): a bad path fails fast
    from engine.llm_engine import LLMEngine

    try:
        llm = LLMEngine(EngineConfig.from_kwargs(model, **kwargs))
    except Exception as e:  # transformers/safetensors/config errors: a one-line reason, no traceback
        logger.debug("engine start-up failed", exc_info=True)
        raise StartupError(f"cannot load model from {model}: {type(e).__name__}: {e}") from None
    # Clients may name the model by directory name or by the path it was loaded from.
    names = [args.served_model_name] if args.served_model_name else [Path(model).name, model]
    async_engine = AsyncLLMEngine(llm, max_waiting_requests=args.max_waiting_requests)
    async_engine.metrics = EngineMetrics(names[0], lambda: async_engine.stats)
    connector_metrics = getattr(llm.connector, "metrics", None)
    if connector_metrics is not None:  # KV hand-off counters (hits, loads, saves, fallbacks) on /metrics
        async_engine.metrics.registry.register(connector_metrics)
    return async_engine, names


def listen_socket(host: str, port: int) -> socket.socket:
    try:
        sock = socket.create_server((host, port), reuse_port=False)
    except OSError as e:
        raise StartupError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.setblocking(False)
    return sock


async def serve(app: web.Application, async_engine: Any, sock: socket.socket, name: str, prog: str,
                shutdown_timeout: float) -> None:
    """Run until SIGINT/SIGTERM, then drain: new requests get 503 while in-flight ones finish."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async_engine.start()
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    host, port = sock.getsockname()[:2]
    stats = async_engine.stats
    logger.info("%s ready at http://%s:%d (model %s, max_model_len %d, %d KV blocks)", prog, host, port, name,
                async_engine.engine.max_model_len, stats.num_total_blocks)
    await stop.wait()
    logger.info("%s shutting down: %d requests in flight, up to %.1f s to finish", prog,
                async_engine.num_in_flight, shutdown_timeout)
    await async_engine.shutdown(shutdown_timeout)
    await runner.cleanup()
    logger.info("%s stopped", prog)


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
            asyncio.run(serve(server.app, async_engine, sock, names[0], prog, args.shutdown_timeout))
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
