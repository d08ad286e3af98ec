"""The routing proxy's HTTP side: OpenAI API in, Prefill + Generate over gRPC out.

Validation and response formatting come from serving.protocol, the module pd-serve uses, so
clients see the same API and the same errors from the proxy as from a single node. Per
request: pick a prefill node and `Prefill` (KV committed when it returns; retried on the next
node when one fails), pick a decode node and stream `Generate` back. With no prefill node
left — or a prompt below --local-prefill-threshold — the decode node gets the prompt itself
and prefills locally.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import aiohttp
import grpc
from aiohttp import web

from pdserve.protos import pdserve_pb2 as pb
from pdserve.proxy import dashboard
from pdserve.proxy.admission import Admission, AdmissionConfig, Rejected
from pdserve.proxy.decode_stream import Deadlines, DecodeStream
from pdserve.proxy.fleet import Fleet
from pdserve.proxy.fleet_sources import fleet_sources
from pdserve.proxy.health import HealthMonitor, Node
from pdserve.proxy.lora_routing import AdapterNodes, FleetLoRAEndpoints, adapter_cards, fleet_adapters
from pdserve.proxy.kv_events_consumer import KVEventsConsumer
from pdserve.proxy.kv_index import KVIndex
from pdserve.proxy.meter import Meter
from pdserve.proxy.planner import PlannerConfig
from pdserve.proxy.planner_lease import PlannerLease
from pdserve.proxy.planner_loop import PlannerLoop, sample_interval
from pdserve.proxy.router import DEFAULT_POLICY, Router
from pdserve.serving import errors, tokenize_api
from pdserve.serving import protocol as oai
from pdserve.serving.auth import GrpcSecurity
from pdserve.serving.choices import Assembler, ChoiceOutput, merge, sub_request_id
from pdserve.serving.http import api_middleware
from pdserve.serving.limits import MAX_BODY_BYTES
from pdserve.serving.metrics import CONTENT_TYPE, ProxyMetrics, RequestMetrics
from pdserve.serving.responses import ResponseBuilder, models_list
from pdserve.serving.sse import SSEStream
from pdserve.serving.wire import (delta_from_pb, lora_to_pb, positions_from_pb, prompt_to_pb, sampling_to_pb,
                                  token_ids_to_pb, tokenize_to_pb, usage_from_pb)

logger = logging.getLogger(__name__)


@dataclass
class ProxyConfig:
    prefill: list[str]  # static gRPC addresses; the fleet's other sources add nodes as they come and go
    decode: list[str]
    fleet_registry: str | None = None  # redis:// URL of the fleet registry nodes announce in (serving/announce.py)
    prefill_dns: str | None = None  # NAME:PORT whose A records are prefill nodes (a headless Service)
    decode_dns: str | None = None
    policy: str = DEFAULT_POLICY
    local_prefill_threshold: int = 0  # prompts shorter than this many tokens skip the prefill node
    api_key: str | None = None
    health_interval_s: float = 1.0
    grpc_security: GrpcSecurity = field(default_factory=GrpcSecurity)  # TLS / key towards the nodes
    deadlines: Deadlines = field(default_factory=Deadlines)  # every decode call's
    prefill_timeout_s: float = 120.0  # one Prefill call; a node that leaves rotation meanwhile is given up at once
    return_tokens_as_token_ids: bool = False  # vLLM's --return-tokens-as-token-ids: the field's default
    kv_events: str | None = None  # redis:// URL of the nodes' KV event stream (serving/kv_events.py): kv-aware's index
    planner: PlannerConfig = field(default_factory=PlannerConfig)  # off without an SLO (proxy/planner.py)
    admission: AdmissionConfig | None = None  # None: every request runs at once (proxy/admission.py)


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
        # With KV events, kv-aware routes from one index both routers share (proxy/kv_index.py).
        index = KVIndex() if config.kv_events and config.policy == "kv-aware" else None
        self.prefill = Router([], config.policy, index=index)  # the fleet fills both, and keeps them current
        self.decode = Router([], config.policy, index=index)
        self.metrics = ProxyMetrics(lambda: self.prefill.nodes + self.decode.nodes)
        self.monitor = HealthMonitor(lambda: self.prefill.nodes + self.decode.nodes, config.health_interval_s,
                                     sample_s=sample_interval(config.planner))
        self.fleet = Fleet({"prefill": self.prefill, "decode": self.decode}, fleet_sources(
            config.prefill, config.decode, config.fleet_registry, config.prefill_dns, config.decode_dns),
            config.grpc_security, self.monitor.check)
        if index is not None and config.kv_events:
            self.fleet.kv_events = KVEventsConsumer(config.kv_events, index)
        lease = PlannerLease(config.fleet_registry, config.planner.interval_s) \
            if config.planner.enabled and config.fleet_registry else None
        self.planner = PlannerLoop(config.planner, self.fleet, lambda: self.prefill.nodes + self.decode.nodes, lease)
        self.metrics.registry.register(self.planner)
        self.admission = Admission(self.planner.saturated, config.admission) if config.admission else None
        self.created = int(time.time())

    # ------------------------------------------------------------ lifecycle
    async def start(self, app: web.Application) -> None:
        await self.fleet.start()  # every source once: the nodes known at start are checked before the ready line
        await self.monitor.check_all()
        self.monitor.start()
        if self.fleet.kv_events is not None:
            self.fleet.kv_events.start()
        self.planner.start()

    async def stop(self, app: web.Application) -> None:
        await self.planner.stop()
        await self.monitor.stop()
        await self.fleet.stop()

    def app(self) -> web.Application:
        app = web.Application(middlewares=[api_middleware(self._count, api_key=self.config.api_key)],
                              client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/status", self.status)
        self.fleet.add_routes(app)
        app.router.add_get("/planner", self.planner.handle)
        app.router.add_get("/metrics", self.prometheus)
        dashboard.add_routes(app)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/version", self.version)
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        FleetLoRAEndpoints(lambda: self.prefill.nodes + self.decode.nodes, self.monitor.check_all).add_routes(app)
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.stop)
        return app

    def _count(self, request: web.Request, outcome: str) -> None:
        """A generation request that failed (the middleware saw it): counted by outcome, as pd-serve counts it."""
        if request.path in ("/v1/completions", "/v1/chat/completions"):
            self.metrics.requests.record_outcome(request.get("model") or self._known_model(), outcome)

    def _known_model(self) -> str:
        """The served name the nodes reported last (a request that failed before naming its model)."""
        return next((n.model_names[0] for n in self.decode.nodes + self.prefill.nodes if n.model_names), "")

    # ------------------------------------------------------------ simple endpoints
    def _model_names(self) -> tuple[list[str], int]:
        nodes = self.decode.healthy() or self.prefill.healthy()
        if not nodes:
            raise oai.service_unavailable("no healthy decode node", "no_healthy_decode_node")
        return nodes[0].model_names, nodes[0].max_model_len

    def _check_model(self, model: str | None) -> tuple[str, str | None, int]:
        """(the name to answer with, the LoRA adapter it names or None, max_model_len); vLLM's 404 naming the
        served names and the fleet's adapters when neither serves it."""
        names, max_len = self._model_names()
        if model is None or model in names:
            return model or names[0], None, max_len
        adapters = fleet_adapters(self.decode.nodes)  # a decode node must run it; a prefill node may
        return oai.check_model(model, [*names, *adapters]), model, max_len

    async def models(self, request: web.Request) -> web.Response:
        names, max_len = self._model_names()
        return web.json_response(models_list(names, max_len, self.created,
                                             adapter_cards(fleet_adapters(self.decode.nodes), names[0])))

    async def health(self, request: web.Request) -> web.Response:
        """200 once a decode node and, where prefill nodes are configured, a prefill node are in rotation (vLLM's
        P/D router); 503 before, and while either role has none (requests then still run: a decode node
        prefills itself)."""
        ok = bool(self.decode.healthy()) and (not self.prefill.nodes or bool(self.prefill.healthy()))
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

    async def tokenize(self, request: web.Request) -> web.Response:
        req = tokenize_api.parse_tokenize(await request.read())
        self._check_model(req.model)  # an adapter shares the base model's tokenizer
        reply = await self._ask_node("Tokenize", tokenize_to_pb(req))
        return web.json_response(tokenize_api.tokenize_response(
            list(reply.tokens), reply.max_model_len, list(reply.token_strs) if req.return_token_strs else None))

    async def detokenize(self, request: web.Request) -> web.Response:
        model, token_ids = tokenize_api.parse_detokenize(await request.read())
        self._check_model(model)
        reply = await self._ask_node("Detokenize", pb.DetokenizeRequest(tokens=token_ids))
        return web.json_response(tokenize_api.detokenize_response(reply.prompt))

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response(tokenize_api.version_response())

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """vLLM's POST /reset_prefix_cache, on every node (its HTTP port): 200 once all of them did, else a 503
        naming those that did not."""
        nodes = self.prefill.nodes + self.decode.nodes
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            answers = await asyncio.gather(*(node.post_http(http, "/reset_prefix_cache") for node in nodes))
        failed = [f"{node.role} {node.address}: " + (f"HTTP {code}" if code else why)
                  for node, (code, why) in zip(nodes, answers) if code != 200]
        if failed:
            raise oai.service_unavailable(f"prefix cache not reset on {len(failed)} of {len(nodes)} nodes: "
                                          + "; ".join(failed), "reset_failed")
        return web.Response(status=200)

    async def _ask_node(self, method: str, call: object, timeout_s: float = 30.0) -> object:
        """A unary call on the first healthy node that answers (decode nodes first): the tokenizer's endpoints."""
        for node in self.decode.healthy() + self.prefill.healthy():
            try:
                return await getattr(node.stub, method)(call, timeout=timeout_s)
            except grpc.aio.AioRpcError as e:
                if (err := _client_error(e)) is not None:
                    raise err from None
                logger.warning("%s on %s failed (%s); trying the next node", method, node.address, e.code().name)
        raise oai.service_unavailable("no healthy node to ask", "no_healthy_node")

    # ------------------------------------------------------------ generation
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, oai.COMPLETION)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, oai.CHAT)

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        t0 = time.perf_counter()
        req = oai.parse_request(kind, await request.read(), check_grammar=False,  # nodes check grammars
                                return_tokens_as_token_ids=self.config.return_tokens_as_token_ids)
        rid = request["request_id"] = oai.request_id_of(req, request.headers.get("X-Request-Id"),
                                                        request["request_id"])
        model, lora, max_model_len = self._check_model(req.model)
        request["model"] = model
        oai.check_prompt_size(req, max_model_len)  # before any node tokenizes a hopeless prompt
        if self.admission is not None:
            try:
                await self.admission.admit(rid)
            except Rejected as e:  # 429 + Retry-After: the middleware logs and counts it
                request["outcome"], request["summary"] = "rejected", f", rate_limit_exceeded: {e}"
                return e.response()
        subs = req.per_prompt()  # each prompt of a batch: its own Prefill + Generate, all at once
        streams = [self._one_prompt(sub_request_id(rid, p, len(subs)), sub, max_model_len, lora)
                   for p, sub in enumerate(subs)]
        builder = ResponseBuilder(req, rid, model)
        assembler = Assembler(req, len(subs))
        meter = Meter(self.metrics.requests, model, t0)
        async with contextlib.aclosing(meter.deltas(merge(streams))) as outputs:  # closing cancels every RPC
            first = await anext(outputs)  # errors before the first token are still plain HTTP errors
            if req.stream:
                return await self._stream(request, builder, assembler, subs, first, outputs, meter)
            assembler.add(self._choice_output(subs, *first))
            async for p, d in outputs:
                assembler.add(self._choice_output(subs, p, d))
        usage = assembler.usage()
        meter.finished(usage, assembler.finish_reason or "abort")
        response = web.json_response(builder.response(assembler.all(), usage), headers={"X-Request-Id": rid})
        with contextlib.suppress(ConnectionResetError):  # a client gone meanwhile (aiohttp ignores it too)
            await response.prepare(request)  # sent before the log line: the client need not wait for it
            await response.write_eof()
        logger.info("Reqid: %s, done: %d tokens, finish %s, %.1f ms", rid, usage["completion_tokens"],
                    assembler.finish_reason, (time.perf_counter() - t0) * 1e3)
        return response

    def _choice_output(self, subs: list[oai.GenerationRequest], p: int, d: pb.GenerateDelta) -> ChoiceOutput:
        sub = subs[p]
        text = sub.prompt if isinstance(sub.prompt, str) else d.prompt_text  # token ids: the node decoded them
        usage = usage_from_pb(d) if d.HasField("usage") else None  # on a choice's first delta: its prompt's counts
        prompt_tokens = (usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]) if usage else None
        return ChoiceOutput(p, delta_from_pb(d, sub.logprobs), lambda: text,
                            lambda: positions_from_pb(d.prompt_logprobs), usage if d.finish_reason else None,
                            prompt_tokens, list(d.prompt_token_ids) if d.prompt_token_ids else None)

    async def _stream(self, request: web.Request, builder: ResponseBuilder, assembler: Assembler,
                      subs: list[oai.GenerationRequest], first: tuple[int, pb.GenerateDelta],
                      outputs: AsyncIterator[tuple[int, pb.GenerateDelta]], meter: Meter) -> web.StreamResponse:
        rid = request["request_id"]
        sse = SSEStream(builder, assembler.choice_usage)
        d = assembler.delta(self._choice_output(subs, *first))  # before start: the prompt's counts
        await sse.start(request, rid, d.prompt_token_ids)
        n = 0
        try:
            await sse.delta(d)
            async for p, d in outputs:
                n += len(d.token_ids)
                await sse.delta(assembler.delta(self._choice_output(subs, p, d)))
        except oai.APIError as e:  # the decode node died mid-stream: tell the client in-band
            logger.warning("Reqid: %s, stream failed after %d tokens: %s", rid, n, e.message)
            meter.metrics.record_outcome(meter.model, errors.outcome(e))
            await sse.error(e)
            return await sse.finish(None)
        usage = assembler.usage()
        response = await sse.finish(usage)
        meter.finished(usage, assembler.finish_reason or "abort")
        logger.info("Reqid: %s, done: %d tokens, finish %s, %.1f ms", rid, usage["completion_tokens"],
                    assembler.finish_reason, (time.perf_counter() - meter.t0) * 1e3)
        return response

    async def _one_prompt(self, rid: str, req: oai.GenerationRequest, max_model_len: int,
                          lora: str | None = None) -> AsyncIterator[pb.GenerateDelta]:
        """One prompt's deltas: Prefill on a prefill node (or not), then Generate on a decode node, both under
        the LoRA adapter `lora` (None: the base model)."""
        prompt = prompt_to_pb(req)
        reply = await self._prefill(rid, req, prompt, lora)
        first = cached = None
        if reply is not None:  # the same 400 as pd-serve before any decoding starts
            token_ids = list(reply.prompt_token_ids)
            req.sampling_params(len(token_ids), max_model_len)
            prompt = token_ids_to_pb(token_ids)
            # One choice: decode continues from the token the prefill node sampled, so the prompt's last
            # position is computed once, there, as monolithic serving computes it (docs/architecture.md).
            if reply.HasField("first_token") and req.n == 1 and not req.sampling.get("use_beam_search"):
                first = reply.first_token
            # Cached means served from an earlier request's KV: the prefill node's hits, as pd-serve would count
            # them. The decode node's count adds what it loaded of this request's own prefill (all of it).
            cached = reply.num_cached_tokens
        # Decode runs under the very weights the prefill's KV was computed under (a node serving other weights
        # under the name would neither find that KV nor produce the same tokens).
        pinned = reply.lora_fingerprint if reply is not None else ""
        async with contextlib.aclosing(self._decode(rid, req, prompt, first, lora, pinned)) as deltas:
            async for d in deltas:
                if cached is not None and d.HasField("usage"):
                    d.usage.cached_tokens = min(cached, d.usage.prompt_tokens)
                yield d

    async def _prefill(self, rid: str, req: oai.GenerationRequest, prompt: pb.Prompt,
                       lora: str | None = None) -> pb.PrefillResponse | None:
        """A prefill node's reply once it has committed the KV; None: let decode prefill locally."""
        if not self.prefill.nodes:  # a decode-only cluster (its ready line says so): nothing to log per request
            return None
        if prompt_size_bound(req) < self.config.local_prefill_threshold:
            logger.info("Reqid: %s, short prompt: decode node prefills locally", rid)
            return None
        if req.sampling["prompt_logprobs"] is not None:  # they need every prompt position's logits
            logger.info("Reqid: %s, prompt_logprobs: decode node computes the whole prompt itself", rid)
            return None
        call = pb.PrefillRequest(request_id=rid, prompt=prompt, params=sampling_to_pb(req),
                                 cache_salt=req.cache_salt or "", lora=lora_to_pb(lora))
        lookup = pb.LookupRequest(prompt=prompt, cache_salt=req.cache_salt or "", lora=lora_to_pb(lora))
        for node in await AdapterNodes.of(self.prefill, lora).rank(lookup):  # only nodes serving the adapter
            node.load.in_flight += 1
            node.routed += 1
            try:
                reply = await self._prefill_on(node, call)
            except asyncio.TimeoutError as e:  # frozen, or left rotation meanwhile: the next node, or local prefill
                node.mark_down(str(e))
                logger.warning("Reqid: %s, prefill on %s failed (%s); trying the next node", rid, node.address, e)
                continue
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
            return reply
        logger.warning("Reqid: %s, no prefill node available: decode node prefills locally", rid)
        return None

    async def _prefill_on(self, node: Node, call: pb.PrefillRequest) -> pb.PrefillResponse:
        """One Prefill under its deadlines: connect, the whole call, and the node staying in rotation
        (a node the health check or another request found dead is not waited for)."""
        await node.ready(self.config.deadlines.connect_s)
        reply = asyncio.ensure_future(node.stub.Prefill(call, timeout=self.config.prefill_timeout_s))
        try:
            while not (await asyncio.wait({reply}, timeout=0.25))[0]:
                if not node.healthy:
                    raise asyncio.TimeoutError(f"left rotation while prefilling ({node.last_error})")
            return reply.result()
        finally:
            reply.cancel()

    def _decode(self, rid: str, req: oai.GenerationRequest, prompt: pb.Prompt, first: pb.FirstToken | None,
                lora: str | None = None, fingerprint: str = "") -> AsyncIterator[pb.GenerateDelta]:
        """Deltas from the decode nodes under the deadlines: retried before the first token, resumed
        on another node after it (proxy/decode_stream.py); APIError when no node is left. Only nodes serving
        the adapter `lora` (with `fingerprint`, when set) are candidates."""
        call = pb.GenerateRequest(request_id=rid, prompt=prompt, params=sampling_to_pb(req),
                                  cache_salt=req.cache_salt or "", first_token=first,
                                  lora=lora_to_pb(lora, fingerprint))
        lookup = pb.LookupRequest(prompt=prompt, cache_salt=req.cache_salt or "", lora=lora_to_pb(lora, fingerprint))
        nodes = AdapterNodes.of(self.decode, lora, fingerprint)
        return DecodeStream(rid, nodes, call, lookup, self.config.deadlines).deltas()

