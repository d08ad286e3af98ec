"""The gRPC wire form of OpenAI requests and outputs, both directions in one place.

The proxy encodes a validated GenerationRequest (`prompt_to_pb`, `sampling_to_pb`) and decodes
the node's GenerateDeltas (`delta_from_pb`); the node decodes the request (`request_from_pb`)
and encodes its outputs (`delta_to_pb`). A new request or output field is added here once, for
both ends.
"""
from __future__ import annotations

from typing import Any

from protos import pdserve_pb2 as pb
from serving import protocol as oai


def prompt_to_pb(req: oai.GenerationRequest) -> pb.Prompt:
    if req.kind == oai.CHAT:
        return pb.Prompt(chat=pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in req.messages]))
    if isinstance(req.prompt, str):
        return pb.Prompt(text=req.prompt)
    return token_ids_to_pb(req.prompt)


def token_ids_to_pb(token_ids: list[int]) -> pb.Prompt:
    if max(token_ids) >= 2**32:  # the wire type; the node's vocabulary check covers the rest
        raise oai.bad_request(f"prompt token ids must be below 2^32; got {max(token_ids)}", "prompt")
    return pb.Prompt(token_ids=pb.TokenIds(ids=token_ids))


def sampling_to_pb(req: oai.GenerationRequest) -> pb.SamplingParams:
    s = req.sampling
    return pb.SamplingParams(max_tokens=req.max_tokens or 0, temperature=s["temperature"], top_p=s["top_p"],
                             top_k=s["top_k"], seed=s["seed"], stop=s["stop"], ignore_eos=s["ignore_eos"],
                             logprobs=req.logprobs, top_logprobs=req.top_logprobs)


def request_from_pb(prompt: pb.Prompt, params: pb.SamplingParams, cache_salt: str) -> oai.GenerationRequest:
    """The protocol module's request for a gRPC call, so limits and messages match the HTTP API."""
    kind_of = prompt.WhichOneof("kind")
    kind = oai.CHAT if kind_of == "chat" else oai.COMPLETION
    sampling = {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                "seed": params.seed if params.HasField("seed") else None, "stop": list(params.stop),
                "stop_token_ids": list(params.stop_token_ids), "ignore_eos": params.ignore_eos}
    return oai.GenerationRequest(
        kind=kind, model=None, max_tokens=params.max_tokens or None, logprobs=params.logprobs,
        top_logprobs=params.top_logprobs,
        cache_salt=cache_salt or None, sampling=sampling,
        prompt=prompt.text if kind_of == "text" else (list(prompt.token_ids.ids) if kind_of == "token_ids" else None),
        messages=[{"role": m.role, "content": m.content} for m in prompt.chat.messages] if kind == oai.CHAT else None)


def delta_to_pb(d: oai.Delta, usage: dict[str, Any] | None = None) -> pb.GenerateDelta:
    """A node's output delta; `usage` (protocol.usage_dict) rides on the last one."""
    out = pb.GenerateDelta(text=d.text, token_ids=d.token_ids, finish_reason=d.finish_reason or "",
                           logprobs=d.logprobs, tokens=d.tokens or [],
                           top_logprobs=[pb.TopLogprobs(tokens=[t for t, _ in top], logprobs=[lp for _, lp in top])
                                         for top in d.top_logprobs])
    if usage is not None:
        out.usage.CopyFrom(pb.Usage(prompt_tokens=usage["prompt_tokens"],
                                    completion_tokens=usage["completion_tokens"],
                                    cached_tokens=usage["prompt_tokens_details"]["cached_tokens"]))
    return out


def delta_from_pb(d: pb.GenerateDelta, logprobs: bool) -> oai.Delta:
    return oai.Delta(d.text, list(d.token_ids), list(d.logprobs), list(d.tokens) if logprobs else None,
                     [list(zip(t.tokens, t.logprobs)) for t in d.top_logprobs], d.finish_reason or None)


def usage_from_pb(d: pb.GenerateDelta) -> dict[str, Any]:
    u = d.usage
    return oai.usage_dict(u.prompt_tokens, u.completion_tokens, u.cached_tokens)
