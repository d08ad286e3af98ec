"""The routing proxy's HTTP side: OpenAI API in, Prefill + Generate over gRPC out.

Validation and response formatting come from serving.protocol, the module pd-serve uses, so
clients see the same API and the same errors from the proxy as from a single node. Per
request: pick a prefill node and `Prefill` (KV committed when it returns; retried on the next
node when one fails), pick a decode node and stream `Generate` back. With no prefill node
left — or a prompt below --local-prefill-threshold — the decode node gets the prompt itself
and prefills locally.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc
from aiohttp import web

from protos import pdserve_pb2 as pb
from proxy import dashboard
from proxy.health import HealthMonitor, Node
from proxy.router import DEFAULT_POLICY, Router
from serving import errors
from serving import protocol as oai
from serving.auth import GrpcSecurity
from serving.http import api_middleware
from serving.metrics import CONTENT_TYPE, ProxyMetrics
from serving.sse import SSEStream
from serving.wire import delta_from_pb, prompt_to_pb, sampling_to_pb, token_ids_to_pb, usage_from_pb

logger = logging.getLogger(__name__)

_UNAVAILABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)


@dataclass
class ProxyConfig:
    prefill: list[str]
    decode: list[str]
    policy: str = DEFAULT_POLICY
    local_prefill_threshold: int = 0  # prompts shorter than this many tokens skip the prefill node
    api_key: str | None = None
    health_interval_s: float = 1.0
    grpc_security: GrpcSecurity = field(default_factory=GrpcSecurity)  # TLS / key towards the nodes
    prefill_timeout_s: float = 600.0


def _client_error(e: grpc.aio.AioRpcError) -> oai.APIError | None:
    """A 4xx the node raised: the request itself is bad, so no other node will take it either."""
    err = errors.from_rpc_error(e)
    return err if err is not None and err.status < 500 else None


def prompt_size_bound(req: oai.GenerationRequest) -> int:
    """Upper bound on the prompt's token count without a tokenizer: exact for token ids, UTF-8
    bytes for text (byte-level and BPE tokens each cover at least one byte; template markup aside)."""
    if req.kind == oai.CHAT:
        return sum(len(m["content"].encode()) for m in req.messages)
    return len(req.prompt) if isinstance(req.prompt, list) else len(req.prompt.encode())


class Proxy:
    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.prefill = Router([Node(a, "prefill", config.grpc_security) for a in config.prefill], config.policy)
        self.decode = Router([Node(a, "decode", config.grpc_security) for a in config.decode], config.policy)
        self.metrics = ProxyMetrics(lambda: self.prefill.nodes + self.decode.nodes)
        self.monitor = HealthMonitor(self.prefill.nodes + self.decode.nodes, config.health_interval_s)
        self.created = int(time.time())

    # ------------------------------------------------------------ lifecycle
    async def start(self, app: web.Application) -> None:
        for node in self.monitor.nodes:
            node.connect()
        await self.monitor.check_all()
        self.monitor.start()

    async def stop(self, app: web.Application) -> None:
        await self.monitor.stop()
        for node in self.prefill.nodes + self.decode.nodes:
            await node.close()

    def app(self) -> web.Application:
        app = web.Application(middlewares=[api_middleware(api_key=self.config.api_key)], client_max_size=64 << 20)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/status", self.status)
        app.router.add_get("/metrics", self.prometheus)
        dashboard.add_routes(app)
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.stop)
        return app

    # ------------------------------------------------------------ simple endpoints
    def _model_names(self) -> tuple[list[str], int]:
        nodes = self.decode.healthy() or self.prefill.healthy()
        if not nodes:
            raise oai.service_unavailable("no healthy decode node", "no_healthy_decode_node")
        return nodes[0].model_names, nodes[0].max_model_len

    async def models(self, request: web.Request) -> web.Response:
        names, max_len = self._model_names()
        return web.json_response(oai.models_list(names, max_len, self.created))

    async def health(self, request: web.Request) -> web.Response:
        ok = bool(self.decode.healthy())
        return web.json_response({"status": "ok" if ok else "unavailable",
                                  "prefill": len(self.prefill.healthy()), "decode": len(self.decode.healthy())},
                                 status=200 if ok else 503)

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def status(self, request: web.Request) -> web.Response:
        return web.json_response({"policy": self.config.policy,
                                  "local_prefill_threshold": self.config.local_prefill_threshold,
                                  "prefill": [n.status() for n in self.prefill.nodes],
                                  "decode": [n.status() for n in self.decode.nodes]})

    # ------------------------------------------------------------ generation
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, oai.COMPLETION)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, oai.CHAT)

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        rid = request["request_id"]
        t0 = time.perf_counter()
        req = oai.parse_request(kind, await request.read())
        names, max_model_len = self._model_names()
        model = oai.check_model(req, names)
        prompt = prompt_to_pb(req)
        token_ids = await self._prefill(rid, req, prompt)
        if token_ids is not None:  # the same 400 as pd-serve before any decoding starts
            req.sampling_params(len(token_ids), max_model_len)
            prompt = token_ids_to_pb(token_ids)
        async with contextlib.aclosing(self._decode(rid, req, prompt)) as deltas:  # closing cancels the RPC
            first = await anext(deltas)  # errors before the first token are still plain HTTP errors
            builder = oai.ResponseBuilder(req, rid, model)
            if req.stream:
                return await self._stream(request, builder, first, deltas, t0)
            parts, last = [], first
            async for last in _chain(first, deltas):
                parts.append(delta_from_pb(last, req.logprobs))
        whole = oai.Delta("".join(p.text for p in parts), [t for p in parts for t in p.token_ids],
                          [lp for p in parts for lp in p.logprobs],
                          [t for p in parts for t in p.tokens] if req.logprobs else None,
                          [top for p in parts for top in p.top_logprobs], last.finish_reason)
        logger.info("Reqid: %s, done: %d tokens, finish %s, %.1f ms", rid, len(whole.token_ids), last.finish_reason,
                    (time.perf_counter() - t0) * 1e3)
        return web.json_response(builder.response(whole, usage_from_pb(last), token_ids),
                                 headers={"X-Request-Id": rid})

    async def _stream(self, request: web.Request, builder: oai.ResponseBuilder, first: pb.GenerateDelta,
                      deltas: AsyncIterator[pb.GenerateDelta], t0: float) -> web.StreamResponse:
        rid = request["request_id"]
        sse = SSEStream(builder)
        await sse.start(request, rid)
        last, n = first, 0
        try:
            async for d in _chain(first, deltas):
                last, n = d, n + len(d.token_ids)
                await sse.delta(delta_from_pb(d, builder.req.logprobs))
        except oai.APIError as e:  # the decode node died mid-stream: tell the client in-band
            logger.warning("Reqid: %s, stream failed after %d tokens: %s", rid, n, e.message)
            await sse.error(e)
            return await sse.finish(None)
        logger.info("Reqid: %s, done: %d tokens, finish %s, %.1f ms", rid, n, last.finish_reason,
                    (time.perf_counter() - t0) * 1e3)
        return await sse.finish(usage_from_pb(last))

    async def _prefill(self, rid: str, req: oai.GenerationRequest, prompt: pb.Prompt) -> list[int] | None:
        """Prompt token ids once a prefill node has committed the KV; None: let decode prefill locally."""
        if prompt_size_bound(req) < self.config.local_prefill_threshold:
            logger.info("Reqid: %s, short prompt: decode node prefills locally", rid)
            return None
        call = pb.PrefillRequest(request_id=rid, prompt=prompt, params=sampling_to_pb(req),
                                 cache_salt=req.cache_salt or "")
        lookup = pb.LookupRequest(prompt=prompt, cache_salt=req.cache_salt or "")
        for node in await self.prefill.rank(lookup):
            node.load.in_flight += 1
            node.routed += 1
            try:
                reply = await node.stub.Prefill(call, timeout=self.config.prefill_timeout_s)
            except grpc.aio.AioRpcError as e:
                if (err := _client_error(e)) is not None:
                    raise err from None
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    node.mark_down(e.details() or "unavailable")
                logger.warning("Reqid: %s, prefill on %s failed (%s: %s); trying the next node", rid,
                               node.address, e.code().name, e.details())
                continue
            finally:
                node.load.in_flight -= 1
            logger.info("Reqid: %s, prefilled on %s: %d tokens, %d cached, %.1f ms", rid, node.address,
                        len(reply.prompt_token_ids), reply.num_cached_tokens, reply.prefill_ms)
            return list(reply.prompt_token_ids)
        logger.warning("Reqid: %s, no prefill node available: decode node prefills locally", rid)
        return None

    async def _decode(self, rid: str, req: oai.GenerationRequest,
                      prompt: pb.Prompt) -> AsyncIterator[pb.GenerateDelta]:
        """Deltas from a decode node. Before its first delta a failed node is skipped for the next;
        after it, the failure ends the request with a clean 503 error."""
        call = pb.GenerateRequest(request_id=rid, prompt=prompt, params=sampling_to_pb(req),
                                  cache_salt=req.cache_salt or "")
        lookup = pb.LookupRequest(prompt=prompt, cache_salt=req.cache_salt or "")
        last_error = oai.service_unavailable("no healthy decode node", "no_healthy_decode_node")
        for node in await self.decode.rank(lookup):
            node.load.in_flight += 1
            node.routed += 1
            stream = node.stub.Generate(call)
            started = False
            try:
                async for delta in stream:
                    if not started:
                        logger.info("Reqid: %s, decoding on %s", rid, node.address)
                    started = True
                    yield delta
                return
            except grpc.aio.AioRpcError as e:
                if (err := _client_error(e)) is not None:
                    raise err from None
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    node.mark_down(e.details() or "unavailable")
                last_error = errors.from_rpc_error(e) or last_error  # e.g. its queue is full
                if started or e.code() not in _UNAVAILABLE:
                    raise oai.APIError(503, f"decode node {node.address} failed during the request: "
                                       f"{e.code().name}: {e.details()}", code="decode_node_failed") from None
                logger.warning("Reqid: %s, decode on %s failed before its first token (%s); trying the next",
                               rid, node.address, e.code().name)
            finally:
                stream.cancel()  # no-op once finished; aborts the node's request if the client left
                node.load.in_flight -= 1
        raise last_error


async def _chain(first: pb.GenerateDelta, rest: AsyncIterator[pb.GenerateDelta]) -> AsyncIterator[pb.GenerateDelta]:
    yield first
    async for d in rest:
        yield d
