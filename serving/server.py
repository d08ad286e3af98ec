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

from pdserve.common import eventloop
from pdserve.common.cpu_budget import prepare_openmp
from pdserve.engine.async_engine import RequestAbortedError
from pdserve.engine.sampling_params import SamplingParams
from pdserve.serving import errors
from pdserve.serving import protocol as oai
from pdserve.serving import tokenize_api
from pdserve.serving.choices import Assembler, ChoiceOutput, merge, prompt_positions, sub_request_id
from pdserve.serving.cli import ArgumentParser, add_engine_args, add_server_args, setup_logging
from pdserve.serving.errors import StartupError
from pdserve.serving.http import STOP_GRACE_S, api_middleware, json_response, listen_socket, serve_app
from pdserve.serving.limits import MAX_BODY_BYTES, HttpTimeouts
from pdserve.serving.lora_modules import lora_body, served_loras
from pdserve.serving.metrics import CONTENT_TYPE
from pdserve.serving.responses import Delta, ResponseBuilder, models_list, token_namer, top_token_texts, usage_dict
from pdserve.serving.sse import SSEStream
from pdserve.serving.startup import create_async_engine

logger = logging.getLogger(__name__)

_GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")
_TOKENIZE_IN_EXECUTOR_CHARS = 8192  # bigger prompts are tokenized off the event loop


class OpenAIServer:
    """The aiohttp application of one node: OpenAI endpoints plus /health, /stats, /metrics."""

    def __init__(self, async_engine: Any, served_model_names: list[str], metrics: Any,
                 return_tokens_as_token_ids: bool = False, timeouts: HttpTimeouts = HttpTimeouts()) -> None:
        self.async_engine = async_engine
        self.return_tokens_as_token_ids = return_tokens_as_token_ids  # vLLM's flag: the default of the field
        self.engine = async_engine.engine  # the LLMEngine ("engine" means LLMEngine everywhere)
        self.tokenizer = self.engine.tokenizer
        self.served_names = served_model_names
        self.metrics = metrics
        self.timeouts = timeouts  # the HTTP edge's deadlines (serving/http_edge.py)
        self.created = int(time.time())
        self.app = web.Application(middlewares=[api_middleware(self._count)], client_max_size=MAX_BODY_BYTES)
        self.app.add_routes([
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.get("/v1/models", self.models),
            web.get("/health", self.health),
            web.get("/stats", self.stats),
            web.get("/metrics", self.prometheus),
            web.post("/tokenize", self.tokenize),
            web.post("/detokenize", self.detokenize),
            web.get("/version", self.version),
            web.post("/reset_prefix_cache", self.reset_prefix_cache),
            web.post("/v1/load_lora_adapter", self.load_lora_adapter),
            web.post("/v1/unload_lora_adapter", self.unload_lora_adapter),
        ])
        # The adapters served by name: those --lora-modules loaded at start-up (serving/startup.py), then the
        # load and unload endpoints'
        self.loras = served_loras(self.engine, served_model_names)

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
        ids = tokenize_api.encode(self.tokenizer, req.prompt, req.messages, req.chat_template,
                                  req.prompt_options.add_special_tokens)
        return req.prompt_options.truncate(ids, self.max_model_len, req.max_tokens)

    async def prompt_token_ids_of(self, req: oai.GenerationRequest) -> list[int]:
        if req.kind != oai.CHAT and isinstance(req.prompt, list):  # token ids (every P/D decode request)
            return req.prompt_options.truncate(req.prompt, self.max_model_len, req.max_tokens)
        oai.check_prompt_size(req, self.engine.max_model_len)  # hopeless sizes never reach the tokenizer
        size = sum(len(m["content"]) for m in req.messages) if req.kind == oai.CHAT else len(req.prompt)
        if size < _TOKENIZE_IN_EXECUTOR_CHARS:
            return self._encode(req)
        return await asyncio.get_running_loop().run_in_executor(None, self._encode, req)

    async def engine_params(self, req: oai.GenerationRequest, prompt_len: int) -> SamplingParams:
        """The engine's params (400 on misfit); a grammar is compiled here, off the event loop and
        the engine's step thread, so the engine finds it in its cache."""
        params = req.sampling_params(prompt_len, self.max_model_len, self.engine.vocab_size)
        if params.structured_outputs is not None:
            try:
                await asyncio.to_thread(self.engine.structured_output.compile, params.structured_outputs)
            except ValueError as e:
                raise oai.bad_request(str(e), req.structured_field) from None
        return params

    def output_delta(self, req: oai.GenerationRequest, out: Any) -> Delta:
        """New engine output of one choice as a Delta, token texts decoded (HTTP and gRPC alike)."""
        name = token_namer(self.tokenizer.decode, req.return_tokens_as_token_ids)
        return Delta(text=out.new_text, token_ids=list(out.new_token_ids),
                     logprobs=list(out.new_logprobs) if req.logprobs else [],
                     tokens=[name(t) for t in out.new_token_ids] if req.logprobs else None,
                     top_logprobs=top_token_texts(name, out.new_top_logprobs),
                     finish_reason=out.finish_reason if out.finished else None, index=out.index)

    def choice_output(self, req: oai.GenerationRequest, prompt_index: int, out: Any) -> ChoiceOutput:
        prompt = req.prompt
        return ChoiceOutput(
            prompt_index, self.output_delta(req, out),
            (lambda: prompt) if isinstance(prompt, str) else (lambda: self.tokenizer.decode(out.prompt_token_ids)),
            lambda: prompt_positions(out.prompt_token_ids, out.prompt_logprobs, self.tokenizer.decode),
            self.usage(out) if out.finished else None, (len(out.prompt_token_ids), out.num_cached_tokens),
            out.prompt_token_ids)

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        req = oai.parse_request(kind, await request.read(), return_tokens_as_token_ids=self.return_tokens_as_token_ids)
        rid = request["request_id"] = oai.request_id_of(req, request.headers.get("X-Request-Id"), request["request_id"])
        model, lora = self.loras.resolve(req.model)
        subs = req.per_prompt()
        prompts = [await self.prompt_token_ids_of(sub) for sub in subs]
        params = [await self.engine_params(sub, len(ids)) for sub, ids in zip(subs, prompts)]
        builder = ResponseBuilder(req, rid, model)
        assembler = Assembler(req, len(subs))
        outputs = merge([self.async_engine.generate(sub_request_id(rid, p, len(subs)), ids, prm, req.cache_salt,
                                                    lora_request=lora)
                         for p, (ids, prm) in enumerate(zip(prompts, params))])
        async with contextlib.aclosing(outputs):
            try:
                first = await anext(outputs)
                if req.stream:
                    await self._stream(request, builder, assembler, subs, outputs, first)
                else:
                    assembler.add(self.choice_output(subs[first[0]], first[0], first[1]))
                    async for p, out in outputs:
                        assembler.add(self.choice_output(subs[p], p, out))
            except Exception as e:  # before a stream started, or a non-streamed request
                err = errors.from_engine_error(e, kind)
                if err is None:
                    raise
                raise err from None
        usage = assembler.usage()
        request["outcome"] = assembler.finish_reason or "abort"
        request["summary"] = (f", prompt {usage['prompt_tokens']} tokens (cached "
                              f"{usage['prompt_tokens_details']['cached_tokens']}), output "
                              f"{usage['completion_tokens']} tokens" + (f", {assembler.num_choices} choices"
                                                                         if assembler.num_choices > 1 else ""))
        if req.stream:
            return request["sse"]
        return json_response(builder.response(assembler.all(), usage))

    @staticmethod
    def usage(out: Any) -> dict[str, Any]:
        """Usage of a choice's StepOutput; its completion count is the whole output only on the final one."""
        return usage_dict(len(out.prompt_token_ids), len(out.token_ids), out.num_cached_tokens)

    async def _stream(self, request: web.Request, builder: ResponseBuilder, assembler: Assembler,
                      subs: list[oai.GenerationRequest], outputs: Any, first: Any) -> None:
        """Write SSE chunks, the choices interleaved as their tokens come, until every choice finished."""
        sse = SSEStream(builder, assembler.choice_usage)
        p, out = first
        d = assembler.delta(self.choice_output(subs[p], p, out))  # before start: the prompt's counts
        await sse.start(request, request["request_id"], d.prompt_token_ids)
        while True:
            await sse.delta(d)
            try:
                p, out = await anext(outputs)
            except StopAsyncIteration:
                break
            except RequestAbortedError:  # shutdown or engine failure: end the stream properly
                for index in assembler.unfinished:
                    await sse.delta(Delta("", finish_reason="abort", index=index))
                break
            d = assembler.delta(self.choice_output(subs[p], p, out))
        await sse.finish(assembler.usage())

    # ------------------------------------------------------------ other endpoints

    async def models(self, request: web.Request) -> web.Response:
        return json_response(models_list(self.served_names, self.max_model_len, self.created,
                                         self.loras.model_cards()))

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

    async def tokenize(self, request: web.Request) -> web.Response:
        req = tokenize_api.parse_tokenize(await request.read())
        self.loras.resolve(req.model)  # an adapter shares the base model's tokenizer
        return json_response(tokenize_api.tokenize_reply(self.tokenizer, req, self.max_model_len))

    async def detokenize(self, request: web.Request) -> web.Response:
        model, token_ids = tokenize_api.parse_detokenize(await request.read())
        self.loras.resolve(model)
        return json_response(tokenize_api.detokenize_response(
            tokenize_api.detokenize(self.tokenizer, token_ids, self.engine.vocab_size)))

    async def version(self, request: web.Request) -> web.Response:
        return json_response(tokenize_api.version_response())

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """vLLM's POST /reset_prefix_cache: 200 once the engine forgot its cached blocks, between two steps."""
        if not self.async_engine.accepting:
            raise oai.service_unavailable("the server is shutting down", "shutting_down")
        await self.async_engine.reset_prefix_cache()
        return web.Response(status=200)

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's POST /v1/load_lora_adapter {"lora_name", "lora_path"}: 200 once the engine loaded it (between
        two steps); 400 for a name already served or an adapter it cannot serve, nothing else disturbed."""
        name, path = lora_body(await request.read(), need_path=True)
        lora = self.loras.request_for(name, path)

        def add() -> str | None:
            try:
                self.engine.add_lora(lora)
            except ValueError as e:  # LoRAError: the directory, its config, its weights or its rank
                return str(e)
            return None

        error = await self.async_engine.call(add)
        if error is not None:
            raise oai.bad_request(error, "lora_path")
        self.loras.add(lora)
        return web.Response(status=200, text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's POST /v1/unload_lora_adapter {"lora_name"}: 200; 404 for a name not served. Requests in
        flight under it finish under it."""
        name, _ = lora_body(await request.read(), need_path=False)
        lora = self.loras.remove(name)
        await self.async_engine.call(lambda: self.engine.remove_lora(lora.lora_int_id))
        return web.Response(status=200, text=f"Success: LoRA adapter '{name}' removed successfully.")


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
                    f"{server.max_model_len}, {engine.stats.num_total_blocks} KV blocks)", drain, handler_timeout_s=5.0,
                    timeouts=server.timeouts, stop_within_s=shutdown_timeout + STOP_GRACE_S)


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
    # First, before anything imports torch (libgomp reads its wait settings once, when it loads): whether this
    # engine's OpenMP workers wait passively (common/cpu_budget.py; the engine logs the outcome at start).
    prepare_openmp(args.threads, (args.tensor_parallel_size or 1) * (args.pipeline_parallel_size or 1))
    try:
        try:
            eventloop.loop_kind()  # a bad PDSERVE_EVENT_LOOP fails before any weights load
        except ValueError as e:
            raise StartupError(str(e)) from None
        if preflight is not None:
            preflight()
        try:
            timeouts = HttpTimeouts.from_args(args)
        except ValueError as e:
            raise StartupError(str(e)) from None
        sock = listen_socket(args.host, args.port)
        async_engine, names = create_async_engine(args)
        server = OpenAIServer(async_engine, names, async_engine.metrics, args.return_tokens_as_token_ids, timeouts)
        if run is None:
            eventloop.run(serve(server, sock, prog, args.shutdown_timeout))
        else:
            eventloop.run(run(server, sock))
    except StartupError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """`pd-serve`: monolithic serving, the baseline every P/D setup is compared against."""
    return run_node(build_parser().parse_args(argv), "pd-serve")


if __name__ == "__main__":
    sys.exit(main())
