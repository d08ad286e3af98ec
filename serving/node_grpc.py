"""A P/D node: the OpenAI HTTP server plus the gRPC control plane the proxy drives.

Shared by both roles; `prefill_node` and `decode_node` only pick defaults (KV role, ports).
The gRPC servicer runs in the HTTP server's event loop over the same AsyncLLMEngine, and it
validates through serving.protocol exactly like the HTTP API does, so an error raised here
reaches the proxy's client with the body pd-serve would have sent (the JSON rides in the
gRPC status details).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import socket
import time
from typing import Any, AsyncIterator
from urllib.parse import urlsplit

import grpc

from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from serving import protocol as oai
from serving.auth import (
    GrpcSecurity,
    add_node_security_args,
    http_api_key_middleware,
    node_interceptors,
    node_security,
)
from serving.cli import LOG_FORMAT, ArgumentParser, add_engine_args, add_server_args
from serving.server import StartupError, check_model_dir, run_node, serve

logger = logging.getLogger(__name__)

# Across hosts a dead peer is silent (a partition or a power cut sends no RST): HTTP/2 keepalive pings
# every 5 s, unanswered for 5 s, fail the connection and every call on it (UNAVAILABLE) instead of
# leaving a Prefill or a stream waiting forever. The proxy's channels ping (KEEPALIVE_CLIENT_OPTIONS);
# nodes must accept pings that often, even between calls.
KEEPALIVE_CLIENT_OPTIONS = [("grpc.keepalive_time_ms", 5000), ("grpc.keepalive_timeout_ms", 5000),
                            ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)]
_KEEPALIVE_SERVER_OPTIONS = [("grpc.keepalive_permit_without_calls", 1),
                             ("grpc.http2.min_recv_ping_interval_without_data_ms", 4000),
                             ("grpc.http2.max_ping_strikes", 0)]
_GRPC_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20),
                 *_KEEPALIVE_SERVER_OPTIONS]
_STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND}


def default_kv_store() -> str:
    """file:// store under the user's pdserve cache directory (shared by nodes on one host)."""
    from engine.builtin_model import cache_dir

    return (cache_dir() / "kvstore").resolve().as_uri()


def generation_request(prompt: pb.Prompt, params: pb.SamplingParams, cache_salt: str) -> oai.GenerationRequest:
    """The protocol module's request for a gRPC call, so limits and messages match the HTTP API."""
    kind = oai.CHAT if prompt.WhichOneof("kind") == "chat" else oai.COMPLETION
    sampling = {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                "seed": params.seed if params.HasField("seed") else None, "stop": list(params.stop),
                "stop_token_ids": list(params.stop_token_ids), "ignore_eos": params.ignore_eos}
    kind_of = prompt.WhichOneof("kind")
    return oai.GenerationRequest(
        kind=kind, model=None, max_tokens=params.max_tokens or None, logprobs=params.logprobs,
        top_logprobs=params.top_logprobs,
        cache_salt=cache_salt or None, sampling=sampling,
        prompt=prompt.text if kind_of == "text" else (list(prompt.token_ids.ids) if kind_of == "token_ids" else None),
        messages=[{"role": m.role, "content": m.content} for m in prompt.chat.messages] if kind == oai.CHAT else None)


class NodeServicer(pb_grpc.PDNodeServicer):
    """Prefill / Generate / Lookup / Health / Stats over the node's OpenAIServer and engine."""

    def __init__(self, server: Any, role: str) -> None:
        self.server = server  # serving.server.OpenAIServer: tokenization is shared with the HTTP API
        self.engine = server.engine
        self.llm = server.engine.engine
        self.role = role

    async def _abort(self, context: grpc.aio.ServicerContext, err: oai.APIError) -> None:
        """Fail the call with pd-serve's error body, counted by outcome like pd-serve counts it."""
        self.server.metrics.record_outcome("rejected" if err.status == 503 else
                                           ("invalid" if err.status < 500 else "error"))
        code = _STATUS.get(err.status, grpc.StatusCode.UNAVAILABLE)
        if err.code == "queue_full":
            code = grpc.StatusCode.RESOURCE_EXHAUSTED
        await context.abort(code, json.dumps(err.body()))

    async def _token_ids(self, req: oai.GenerationRequest) -> list[int]:
        return await self.server.prompt_token_ids_of(req)  # the HTTP API's own tokenization

    async def _outputs(self, rid: str, req: oai.GenerationRequest, ids: list[int], params: Any,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        """Engine outputs with engine errors mapped to pd-serve's OpenAI errors; aborts when the caller leaves."""
        from engine.async_engine import (
            EngineOverloadedError,
            EngineShutdownError,
            RequestAbortedError,
        )

        outputs = self.engine.generate(rid, ids, params, req.cache_salt)
        finish_reason: str | None = None
        rejected = False  # _abort counts rejections itself
        async with contextlib.aclosing(outputs):
            try:
                async for out in outputs:
                    if out.finished:
                        finish_reason = out.finish_reason
                    yield out
            except EngineOverloadedError as e:
                rejected = True
                await self._abort(context, oai.service_unavailable(str(e), "queue_full"))
            except EngineShutdownError as e:
                rejected = True
                await self._abort(context, oai.service_unavailable(str(e), "shutting_down"))
            except RequestAbortedError as e:
                await context.abort(grpc.StatusCode.ABORTED, str(e))
            except ValueError as e:
                rejected = True
                await self._abort(context, oai.bad_request(str(e), "messages" if req.kind == oai.CHAT else "prompt"))
            finally:  # requests by outcome, as pd-serve's HTTP path counts them (caller gone: abort)
                if not rejected:
                    self.server.metrics.record_outcome(finish_reason or "abort")

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        t0 = time.perf_counter()
        req = generation_request(request.prompt, request.params, request.cache_salt)
        try:
            ids = await self._token_ids(req)
            params = dataclasses.replace(req.sampling_params(len(ids), self.llm.max_model_len), max_tokens=1)
        except oai.APIError as e:
            await self._abort(context, e)
        last = None
        async for last in self._outputs(request.request_id, req, ids, params, context):
            pass
        ms = (time.perf_counter() - t0) * 1e3
        logger.info("Reqid: %s, prefill done: %d prompt tokens, %d cached, KV committed, %.1f ms",
                    request.request_id, len(ids), max(0, last.num_cached_tokens), ms)
        return pb.PrefillResponse(prompt_token_ids=ids, num_cached_tokens=max(0, last.num_cached_tokens),
                                  prefill_ms=ms)

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateDelta]:
        req = generation_request(request.prompt, request.params, request.cache_salt)
        try:
            ids = await self._token_ids(req)
            params = req.sampling_params(len(ids), self.llm.max_model_len)
        except oai.APIError as e:
            await self._abort(context, e)
        if request.prompt.WhichOneof("kind") != "token_ids":
            logger.info("Reqid: %s, local prefill: prompt tokenized here (%d tokens)", request.request_id, len(ids))
        decode = self.llm.tokenizer.decode
        async for out in self._outputs(request.request_id, req, ids, params, context):
            delta = pb.GenerateDelta(text=out.new_text, token_ids=out.new_token_ids,
                                     finish_reason=(out.finish_reason or "") if out.finished else "")
            if req.logprobs:
                delta.logprobs.extend(out.new_logprobs)
                delta.tokens.extend(decode([t]) for t in out.new_token_ids)
                delta.top_logprobs.extend(pb.TopLogprobs(tokens=[t for t, _ in top], logprobs=[lp for _, lp in top])
                                          for top in oai.top_token_texts(decode, out.new_top_logprobs))
            if out.finished:
                delta.usage.CopyFrom(pb.Usage(prompt_tokens=len(ids), completion_tokens=len(out.token_ids),
                                              cached_tokens=max(0, out.num_cached_tokens)))
            yield delta

    async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        """A routing hint: read-only peeks at the prefix cache and the store, never blocking the engine."""
        from engine.request import Request
        from engine.sampling_params import SamplingParams

        req = generation_request(request.prompt, pb.SamplingParams(), request.cache_salt)
        try:
            ids = await self._token_ids(req)
        except oai.APIError as e:
            await self._abort(context, e)
        probe = Request("lookup", ids, SamplingParams(max_tokens=1), cache_salt=req.cache_salt)
        # Hashing a long prompt is CPU work: off the event loop (the pool is only read, never changed).
        _, local = await asyncio.to_thread(self.llm.kv_cache_manager.get_computed_blocks, probe)
        store = 0
        connector = self.llm.connector
        if connector is not None:
            try:  # the connector's own hit computation (H of DESIGN.md section 4)
                store = await asyncio.wait_for(asyncio.to_thread(connector.lookup_hit, probe), 1.0)
            except Exception as e:  # a routing hint: an unreachable store just means "no store hit"
                logger.debug("lookup: store hit unknown (%s)", e)
        return pb.LookupResponse(total_tokens=len(ids), local_hit_tokens=local, store_hit_tokens=store)

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext) -> pb.HealthResponse:
        return pb.HealthResponse(ok=self.engine.accepting, role=self.role,
                                 served_model_names=self.server.served_names, max_model_len=self.llm.max_model_len)

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        s = self.engine.stats
        return pb.StatsResponse(num_running=s.num_running, num_waiting=s.num_waiting,
                                num_free_blocks=s.num_free_blocks, num_total_blocks=s.num_total_blocks,
                                kv_usage=s.kv_usage, prefix_cache_queries=s.prefix_cache_queries,
                                prefix_cache_hits=s.prefix_cache_hits)


# ---------------------------------------------------------------- launcher

@dataclasses.dataclass(frozen=True)
class NodeRole:
    """What distinguishes `pd-prefill` from `pd-decode`: defaults only."""

    name: str  # prefill | decode
    kv_role: str  # producer | consumer
    http_port: int
    grpc_port: int


def build_parser(role: NodeRole) -> ArgumentParser:
    parser = ArgumentParser(prog=f"pd-{role.name}", description=f"pdserve {role.name} node: OpenAI HTTP API plus "
                            "the gRPC control plane for pd-proxy, with a KV connector")
    add_server_args(parser, default_port=role.http_port)
    g = parser.add_argument_group("P/D node")
    g.add_argument("--grpc-port", type=int, default=role.grpc_port,
                   help=f"gRPC port for pd-proxy (default {role.grpc_port}; 0 picks a free one)")
    g.add_argument("--kv-store", default=None, help="shared KV store: file:///dir, redis://host:port/db or "
                   "lm://host:port (LMCache server); default file:// under ~/.cache/pdserve/kvstore")
    g.add_argument("--lmcache-config", default=None, help="LMCache YAML config (instead of --kv-store)")
    g.add_argument("--chunk-size", type=int, default=None, help="tokens per stored chunk (default 256)")
    g.add_argument("--kv-role", choices=("producer", "consumer", "both"), default=role.kv_role,
                   help=f"KV connector role (default {role.kv_role})")
    g.add_argument("--kv-load-timeout", dest="load_timeout_s", type=float, default=None,
                   help="seconds to wait for the store before recomputing (default 10)")
    g.add_argument("--log-file", default=None, help="also write the log here (for pd-kv-hits)")
    add_node_security_args(parser)
    add_engine_args(parser)
    return parser


def add_log_file(path: str) -> None:
    """Also log to `path` (what pd-kv-hits reads), in the console format."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logging.getLogger().addHandler(handler)


def check_store(url: str, timeout_s: float = 3.0) -> None:
    """Fail start-up with one line when the store cannot be reached (before loading any weights)."""
    parts = urlsplit(url)
    if parts.scheme == "lm":
        try:
            socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 65432), timeout=timeout_s).close()
        except OSError as e:
            raise StartupError(f"LMCache server {parts.netloc} unreachable: {e.strerror or e}") from None
        return
    from kvstore import StoreError, open_store

    try:  # one real round trip: redis connects lazily
        with open_store(url, timeout=timeout_s, fingerprint="0" * 32) as store:
            store.lookup(["0" * 32])
            unbounded = store.bounds_warning()
    except (StoreError, ValueError, OSError) as e:
        raise StartupError(f"KV store {url} unusable: {e}") from None
    if unbounded:
        logger.warning(unbounded)


async def serve_with_grpc(server: Any, servicer: NodeServicer, sock: socket.socket, grpc_host: str,
                          grpc_port: int, prog: str, shutdown_timeout: float,
                          security: GrpcSecurity = GrpcSecurity()) -> None:
    grpc_server = grpc.aio.server(options=_GRPC_OPTIONS, interceptors=node_interceptors(security))
    pb_grpc.add_PDNodeServicer_to_server(servicer, grpc_server)
    credentials = security.server_credentials()
    try:
        address = f"{grpc_host}:{grpc_port}"
        bound = grpc_server.add_insecure_port(address) if credentials is None else \
            grpc_server.add_secure_port(address, credentials)
    except RuntimeError as e:
        raise StartupError(f"cannot listen on {grpc_host}:{grpc_port} (gRPC): {e}") from None
    if security.api_key:
        server.app.middlewares.append(http_api_key_middleware(security.api_key))
    logger.log(*security.describe_server(f"{grpc_host}:{bound}"))
    await grpc_server.start()
    try:
        await serve(server.app, server.engine, sock, server.served_names[0],
                    f"{prog} [gRPC {grpc_host}:{bound}]", shutdown_timeout)
    finally:
        await grpc_server.stop(grace=1.0)
        # The connector's threads and connections (LMCache's especially) would keep the process alive.
        await asyncio.to_thread(server.engine.engine.shutdown)


def node_main(role: NodeRole, argv: list[str] | None = None) -> int:
    parser = build_parser(role)
    args = parser.parse_args(argv)
    if args.kv_store is None and args.lmcache_config is None:
        args.kv_store = default_kv_store()

    security = node_security(args)

    def preflight() -> None:
        try:
            security.check(server=True)
        except ValueError as e:
            raise StartupError(str(e)) from None
        if args.log_file:
            try:
                add_log_file(args.log_file)
            except OSError as e:
                raise StartupError(f"cannot write log file {args.log_file}: {e.strerror or e}") from None
        if args.model is not None:
            check_model_dir(args.model)  # cheap checks first: the store check imports torch
        if args.kv_store:
            check_store(args.kv_store)
        if args.lmcache_config and not os.access(args.lmcache_config, os.R_OK):
            raise StartupError(f"cannot read LMCache config {args.lmcache_config}")

    async def run(server: Any, sock: socket.socket) -> None:
        await serve_with_grpc(server, NodeServicer(server, role.name), sock, args.host, args.grpc_port,
                              parser.prog, args.shutdown_timeout, security)

    return run_node(args, parser.prog, preflight=preflight, run=run)
