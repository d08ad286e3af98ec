"""A P/D node's gRPC servicer: the control plane pd-proxy drives (Prefill, Generate, Lookup, ...).

It runs in the HTTP server's event loop over the same AsyncLLMEngine, and it validates through
serving.protocol exactly like the HTTP API does, so an error raised here reaches the proxy's
client with the body pd-serve would have sent (errors.py: the JSON rides in the gRPC status
details).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator

import grpc

from pdserve.protos import pdserve_pb2 as pb
from pdserve.protos import pdserve_pb2_grpc as pb_grpc
from pdserve.serving import errors
from pdserve.serving import protocol as oai
from pdserve.serving import tokenize_api, wire
from pdserve.serving.choices import prompt_positions
from pdserve.serving.heartbeat import with_heartbeat
from pdserve.serving.node_lora import NodeLoRAs

logger = logging.getLogger(__name__)

_DRAIN_TIMEOUT_S = 60.0  # SetRole's drain when the call names none
_DRAIN_POLL_S = 0.05


class CallFailed(Exception):
    """A call's failure as the status it ends with: raised where the servicer meets it (a rejected
    request, an engine error), turned into the aborted call by Prefill and Generate."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class NodeServicer(pb_grpc.PDNodeServicer):
    """Prefill / Generate / Lookup / Health / Stats over the node's OpenAIServer and engine."""

    def __init__(self, server: Any, role: str, http_port: int = 0, switchable: bool = False) -> None:
        self.server = server  # serving.server.OpenAIServer: tokenization is shared with the HTTP API
        self.async_engine = server.async_engine
        self.engine = server.engine  # LLMEngine: read-only peeks (Lookup, Health)
        self.role = role
        self.http_port = http_port  # where the node serves HTTP (its OpenAI API, /metrics); 0: not known
        self.loras = NodeLoRAs(server)  # a call's adapter, by name (and fingerprint) as pd-serve serves them
        self.switchable = switchable  # --role auto: SetRole moves it between prefill and decode
        self.running = {"prefill": 0, "decode": 0}  # Prefill / Generate calls open now: what a switch drains
        self.on_role_change: Callable[[str], Awaitable[None]] | None = None  # the announcer's re-announce
        self._switch = asyncio.Lock()  # one SetRole at a time

    def _failed(self, err: oai.APIError) -> CallFailed:
        """The call's failure with pd-serve's error body, counted by outcome like pd-serve counts it."""
        self.server.metrics.record_outcome(errors.outcome(err))
        return CallFailed(errors.grpc_code(err), json.dumps(err.body()))

    async def _abort(self, context: grpc.aio.ServicerContext, err: oai.APIError) -> None:
        failed = self._failed(err)
        await context.abort(failed.code, failed.details)

    async def _token_ids(self, req: oai.GenerationRequest) -> list[int]:
        return await self.server.prompt_token_ids_of(req)  # the HTTP API's own tokenization

    async def _outputs(self, rid: str, req: oai.GenerationRequest, ids: list[int], params: Any,
                       resume: Any = None, first_token: Any = None, lora: Any = None) -> AsyncIterator[Any]:
        """Engine outputs with engine errors raised as the call's failure (CallFailed, pd-serve's OpenAI
        errors); closing it (the caller left) aborts the request."""
        from pdserve.engine.async_engine import RequestAbortedError

        outputs = self.async_engine.generate(rid, ids, params, req.cache_salt, resume, first_token, lora)
        finish_reason: str | None = None
        rejected = False  # _abort counts rejections itself
        async with contextlib.aclosing(outputs):
            try:
                async for out in outputs:
                    if out.finished:
                        finish_reason = out.finish_reason
                    yield out
            except RequestAbortedError as e:  # the server's abort, not a rejection: the proxy may retry
                raise CallFailed(grpc.StatusCode.ABORTED, str(e)) from None
            except Exception as e:
                err = errors.from_engine_error(e, req.kind)
                if err is None:
                    raise
                rejected = True
                raise self._failed(err) from None
            finally:  # requests by outcome, as pd-serve's HTTP path counts them (caller gone: abort)
                if not rejected:
                    self.server.metrics.record_outcome(finish_reason or "abort")

    @contextlib.contextmanager
    def _call_of(self, role: str) -> Iterator[None]:
        self.running[role] += 1
        try:
            yield
        finally:
            self.running[role] -= 1

    async def _refuse_other_role(self, role: str, context: grpc.aio.ServicerContext) -> None:
        """A switchable node takes no new call of the role it left: UNAVAILABLE, which a proxy retries on another
        node (one whose fleet has not moved this node yet). A fixed-role node serves whatever it is sent."""
        if self.switchable and self.role != role:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"this node serves as {self.role} now, not {role} "
                                "(moved by the planner)")

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        await self._refuse_other_role("prefill", context)
        with self._call_of("prefill"):
            return await self._prefill(request, context)

    async def _prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        t0 = time.perf_counter()
        req = wire.request_from_pb(request.prompt, request.params, request.cache_salt, _lora_of(request))
        try:
            lora = await self.loras.resolve(_lora_of(request))
            ids = await self._token_ids(req)
            # The prompt's KV, and its first output token sampled as monolithic serving samples it: the
            # decode node streams that token and continues from it (engine/outputs.py FirstToken).
            params = (await self.server.engine_params(req, len(ids))).prefill_only()
        except oai.APIError as e:
            await self._abort(context, e)
        last = None
        try:
            async for last in self._outputs(request.request_id, req, ids, params, lora=lora):
                pass
        except CallFailed as e:
            await context.abort(e.code, e.details)
        ms = (time.perf_counter() - t0) * 1e3
        logger.info("Reqid: %s, prefill done: %d prompt tokens, %d cached, %s, %.1f ms",
                    request.request_id, len(ids), last.num_cached_tokens, self._kv_outcome(request.request_id), ms)
        return pb.PrefillResponse(prompt_token_ids=ids, num_cached_tokens=last.num_cached_tokens,
                                  prefill_ms=ms, first_token=wire.first_token_to_pb(last),
                                  lora_fingerprint=await self.loras.fingerprint(lora) if lora is not None else "")

    def _kv_outcome(self, request_id: str) -> str:
        """What became of a finished prefill's KV: its final output waited for the commit or the failure of
        every save (engine/scheduler.py), and a failure was reported before it (connectors/kv_metrics.py)."""
        metrics = getattr(self.engine.connector, "metrics", None)
        failure = metrics.take_save_failure(request_id) if metrics is not None else None
        return "KV committed" if failure is None else f"KV not saved ({failure})"

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateDelta]:
        await self._refuse_other_role("decode", context)
        with self._call_of("decode"):
            async with contextlib.aclosing(self._deltas(request)) as deltas:
                try:
                    async for delta in deltas:
                        yield delta
                except CallFailed as e:
                    await context.abort(e.code, e.details)

    async def _deltas(self, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateDelta]:
        """Generate's deltas, heartbeats included, up to the one that finishes the last open choice;
        CallFailed on failure."""
        req = wire.request_from_pb(request.prompt, request.params, request.cache_salt, _lora_of(request))
        try:
            lora = await self.loras.resolve(_lora_of(request))
            ids = await self._token_ids(req)
            params = await self.server.engine_params(req, len(ids))
        except oai.APIError as e:
            raise self._failed(e) from None
        if request.prompt.WhichOneof("kind") != "token_ids":
            logger.info("Reqid: %s, local prefill: prompt tokenized here (%d tokens)", request.request_id, len(ids))
        resume = None
        if request.HasField("resume"):  # another decode node started this stream (proxy/decode_stream.py)
            from pdserve.engine.outputs import Resume

            resume = Resume(list(request.resume.output_token_ids), request.resume.num_sent_chars)
        first_token = wire.first_token_from_pb(request.first_token) if request.HasField("first_token") else None
        started: set[int] = set()  # choices that sent their first delta
        open_choices = params.n
        outputs = self._outputs(request.request_id, req, ids, params, resume, first_token, lora)
        async with contextlib.aclosing(with_heartbeat(outputs)) as beats:
            async for out in beats:
                if out is None:  # still waiting (queue, KV load, prefill): an empty delta says "alive"
                    yield pb.GenerateDelta()
                    continue
                # A choice's first delta carries what the proxy needs for echo and prompt_logprobs.
                first = out.index not in started
                started.add(out.index)
                positions = prompt_positions(ids, out.prompt_logprobs, self.server.tokenizer.decode) if first else None
                text = self.server.tokenizer.decode(ids) if first and req.echo else ""
                open_choices -= out.finished
                yield wire.delta_to_pb(self.server.output_delta(req, out),
                                       self.server.usage(out) if out.finished or first else None, positions,
                                       text, ids if first and req.return_token_ids else None)
                if not open_choices:  # the status goes out now, not after one more turn of the engine's stream
                    return

    async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        """A routing hint: read-only peeks at the prefix cache and the store, never blocking the engine."""
        from pdserve.engine.request import Request
        from pdserve.engine.sampling_params import SamplingParams

        req = wire.request_from_pb(request.prompt, pb.SamplingParams(), request.cache_salt, _lora_of(request))
        try:
            lora = await self.loras.resolve(_lora_of(request))
            adapter = await self.loras.adapter(lora) if lora is not None else None  # its fingerprint roots the chains
            ids = await self._token_ids(req)
        except oai.APIError as e:
            await self._abort(context, e)
        probe = Request("lookup", ids, SamplingParams(max_tokens=1), cache_salt=req.cache_salt, lora=adapter)
        # Hashing a long prompt is CPU work: off the event loop (the pool is only read, never changed).
        _, local = await asyncio.to_thread(self.engine.kv_cache_manager.get_computed_blocks, probe)
        store = 0
        connector = self.engine.connector
        if connector is not None:
            try:  # the connector's own hit computation (H in docs/architecture.md)
                # awaits the store's own I/O thread: a frozen store holds no thread of this loop's pool
                store = await asyncio.wait_for(asyncio.wrap_future(connector.start_lookup(probe)), 1.0)
            except Exception as e:  # a routing hint: an unreachable store just means "no store hit"
                logger.debug("lookup: store hit unknown (%s)", e)
        return pb.LookupResponse(total_tokens=len(ids), local_hit_tokens=local, store_hit_tokens=store)

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext) -> pb.HealthResponse:
        return pb.HealthResponse(ok=self.async_engine.accepting, role=self.role,
                                 served_model_names=self.server.served_names, max_model_len=self.engine.max_model_len,
                                 http_port=self.http_port, loras=await self.loras.served(), switchable=self.switchable)

    async def SetRole(self, request: pb.SetRoleRequest, context: grpc.aio.ServicerContext) -> pb.SetRoleResponse:
        """Serve as `request.role` from now on: new calls of the old role are refused at once, those running
        finish (the drain, bounded by its deadline: past it the role switches anyway and they still finish,
        since the node saves and loads KV alike), then the fleet registry hears the new role. The engine, its
        weights and its prefix cache stay: same model, same keys."""
        if not self.switchable:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"this node was started as {self.role}; only "
                                "a node started with --role auto switches roles")
        if request.role not in self.running:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"role must be prefill or decode, not "
                                f"{request.role!r}")
        async with self._switch:
            old, t0 = self.role, time.perf_counter()
            if old == request.role:
                return pb.SetRoleResponse(role=old, previous_role=old)
            self.role = request.role
            deadline = t0 + (request.drain_timeout_s or _DRAIN_TIMEOUT_S)
            while self.running[old] and time.perf_counter() < deadline:
                await asyncio.sleep(_DRAIN_POLL_S)
            drain_ms = (time.perf_counter() - t0) * 1e3
            if self.on_role_change is not None:
                await self.on_role_change(self.role)
            logger.info("role switched from %s to %s: drained in %.1f ms, %d %s calls still running (they finish)",
                        old, self.role, drain_ms, self.running[old], old)
            return pb.SetRoleResponse(role=self.role, previous_role=old, still_running=self.running[old],
                                      drain_ms=drain_ms)

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        """The proxy's /tokenize: this node's tokenizer, the HTTP endpoint's rules."""
        try:
            reply = tokenize_api.tokenize_reply(self.server.tokenizer, wire.tokenize_from_pb(request),
                                                self.engine.max_model_len)
        except oai.APIError as e:
            await self._abort(context, e)
        return pb.TokenizeResponse(tokens=reply["tokens"], token_strs=reply["token_strs"] or [],
                                   max_model_len=reply["max_model_len"])

    async def Detokenize(self, request: pb.DetokenizeRequest,
                         context: grpc.aio.ServicerContext) -> pb.DetokenizeResponse:
        try:
            text = tokenize_api.detokenize(self.server.tokenizer, list(request.tokens), self.engine.vocab_size)
        except oai.APIError as e:
            await self._abort(context, e)
        return pb.DetokenizeResponse(prompt=text)

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        s = self.async_engine.stats
        return pb.StatsResponse(num_running=s.num_running, num_waiting=s.num_waiting,
                                num_free_blocks=s.num_free_blocks, num_total_blocks=s.num_total_blocks,
                                kv_usage=s.kv_usage, prefix_cache_queries=s.prefix_cache_queries,
                                prefix_cache_hits=s.prefix_cache_hits)


def _lora_of(call: pb.PrefillRequest | pb.GenerateRequest | pb.LookupRequest) -> pb.LoRAAdapter | None:
    """The adapter a call names (None: the base model)."""
    return call.lora if call.HasField("lora") else None
