"""The gRPC wire form of OpenAI requests and outputs, both directions in one place.

The proxy encodes a validated GenerationRequest (`prompt_to_pb`, `sampling_to_pb`) and decodes
the node's GenerateDeltas (`delta_from_pb`); the node decodes the request (`request_from_pb`)
and encodes its outputs (`delta_to_pb`). A new request or output field is added here once, for
both ends.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from pdserve.engine.sampling_params import StructuredOutputsParams
from pdserve.protos import pdserve_pb2 as pb
from pdserve.serving import protocol as oai
from pdserve.serving.protocol_chat import ChatTemplateOptions, parse_template_kwargs
from pdserve.serving.protocol_prompt import PromptOptions
from pdserve.serving.responses import Delta, PromptPosition, usage_dict
from pdserve.serving.tokenize_api import TokenizeRequest

if TYPE_CHECKING:
    from pdserve.engine.outputs import FirstToken, StepOutput


def messages_to_pb(messages: list[dict[str, str]]) -> list[pb.ChatMessage]:
    return [pb.ChatMessage(**m) for m in messages]


def messages_from_pb(messages: Iterable[pb.ChatMessage]) -> list[dict[str, str]]:
    """The protocol module's chat messages (a name only where the client gave one)."""
    return [{"role": m.role, "content": m.content, **({"name": m.name} if m.HasField("name") else {})}
            for m in messages]


def chat_to_pb(messages: list[dict[str, str]], options: ChatTemplateOptions) -> pb.ChatMessages:
    return pb.ChatMessages(messages=messages_to_pb(messages), add_generation_prompt=options.add_generation_prompt,
                           continue_final_message=options.continue_final_message,
                           chat_template_kwargs=options.kwargs_json())


def chat_options_from_pb(chat: pb.ChatMessages) -> ChatTemplateOptions:
    try:
        kwargs = parse_template_kwargs(json.loads(chat.chat_template_kwargs)) if chat.chat_template_kwargs else None
    except ValueError:
        raise oai.bad_request("chat_template_kwargs is not a JSON object", "chat_template_kwargs") from None
    return ChatTemplateOptions(not chat.HasField("add_generation_prompt") or chat.add_generation_prompt,
                               chat.continue_final_message, kwargs)


def prompt_to_pb(req: oai.GenerationRequest) -> pb.Prompt:
    """The prompt with what decides its token ids (chat template options, add_special_tokens, truncation)."""
    options = req.prompt_options
    if req.kind == oai.CHAT:
        prompt = pb.Prompt(chat=chat_to_pb(req.messages, req.chat_template))
    elif isinstance(req.prompt, str):
        prompt = pb.Prompt(text=req.prompt)
    else:
        prompt = token_ids_to_pb(req.prompt)
    if options.add_special_tokens is not None:
        prompt.add_special_tokens = options.add_special_tokens
    if options.truncate_prompt_tokens is not None:
        prompt.truncate_prompt_tokens = options.truncate_prompt_tokens
        prompt.truncation_side = options.truncation_side
    return prompt


def prompt_options_from_pb(prompt: pb.Prompt) -> PromptOptions:
    return PromptOptions(prompt.add_special_tokens if prompt.HasField("add_special_tokens") else None,
                         prompt.truncate_prompt_tokens if prompt.HasField("truncate_prompt_tokens") else None,
                         prompt.truncation_side or "left")


def token_ids_to_pb(token_ids: list[int]) -> pb.Prompt:
    if max(token_ids) >= 2**32:  # the wire type; the node's vocabulary check covers the rest
        raise oai.bad_request(f"prompt token ids must be below 2^32; got {max(token_ids)}", "prompt")
    return pb.Prompt(token_ids=pb.TokenIds(ids=token_ids))


def structured_to_pb(spec: StructuredOutputsParams | None, field: str | None) -> pb.StructuredOutputs | None:
    if spec is None:
        return None
    out = pb.StructuredOutputs(disable_any_whitespace=spec.disable_any_whitespace, field=field or "")
    if spec.kind == "json":
        out.json = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
    elif spec.kind == "choice":
        out.choice.CopyFrom(pb.ChoiceList(choices=spec.choice))
    elif spec.kind == "json_object":
        out.json_object = True
    else:
        setattr(out, spec.kind, getattr(spec, spec.kind))
    return out


def structured_from_pb(params: pb.SamplingParams) -> StructuredOutputsParams | None:
    if not params.HasField("structured_outputs"):
        return None
    so = params.structured_outputs
    kind = so.WhichOneof("kind")
    value = list(so.choice.choices) if kind == "choice" else getattr(so, kind)
    return StructuredOutputsParams(**{kind: value}, disable_any_whitespace=so.disable_any_whitespace)


def sampling_to_pb(req: oai.GenerationRequest) -> pb.SamplingParams:
    s = req.sampling
    return pb.SamplingParams(
        max_tokens=req.max_tokens or 0, temperature=s["temperature"], top_p=s["top_p"], top_k=s["top_k"],
        seed=s["seed"], stop=s["stop"], stop_token_ids=s["stop_token_ids"], ignore_eos=s["ignore_eos"],
        logprobs=req.logprobs, top_logprobs=req.top_logprobs, n=s["n"], presence_penalty=s["presence_penalty"],
        frequency_penalty=s["frequency_penalty"], repetition_penalty=s["repetition_penalty"],
        logit_bias=s["logit_bias"] or {}, min_tokens=s["min_tokens"], min_p=s["min_p"],
        include_stop_str_in_output=s["include_stop_str_in_output"], skip_special_tokens=s["skip_special_tokens"],
        prompt_logprobs=s["prompt_logprobs"], structured_outputs=structured_to_pb(s["structured_outputs"], req.structured_field),
        echo=req.echo, return_token_ids=req.return_token_ids, return_tokens_as_token_ids=req.return_tokens_as_token_ids,
        bad_words=s["bad_words"], allowed_token_ids=s["allowed_token_ids"] or [], use_beam_search=s["use_beam_search"],
        length_penalty=s["length_penalty"], logprob_token_ids=s["logprob_token_ids"] or [])


def lora_to_pb(name: str | None, fingerprint: str = "") -> pb.LoRAAdapter | None:
    """The adapter a call runs under (None: the base model; a fingerprint pins the adapter's weights)."""
    return pb.LoRAAdapter(name=name, fingerprint=fingerprint) if name else None


def request_from_pb(prompt: pb.Prompt, params: pb.SamplingParams, cache_salt: str,
                    lora: pb.LoRAAdapter | None = None) -> oai.GenerationRequest:
    """The protocol module's request for a gRPC call, so limits and messages match the HTTP API; its
    `model` is the adapter's name (None: the base model), which the node resolves as pd-serve does."""
    kind_of = prompt.WhichOneof("kind")
    kind = oai.CHAT if kind_of == "chat" else oai.COMPLETION
    prompt_logprobs = params.prompt_logprobs if params.HasField("prompt_logprobs") else None
    sampling = {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                "seed": params.seed if params.HasField("seed") else None, "stop": list(params.stop),
                "stop_token_ids": list(params.stop_token_ids), "ignore_eos": params.ignore_eos, "n": params.n or 1,
                "presence_penalty": params.presence_penalty, "frequency_penalty": params.frequency_penalty,
                "repetition_penalty": params.repetition_penalty if params.HasField("repetition_penalty") else 1.0,
                "logit_bias": dict(params.logit_bias) or None, "min_tokens": params.min_tokens, "min_p": params.min_p,
                "include_stop_str_in_output": params.include_stop_str_in_output,
                "skip_special_tokens": params.skip_special_tokens if params.HasField("skip_special_tokens") else True,
                "prompt_logprobs": prompt_logprobs, "structured_outputs": structured_from_pb(params),
                "bad_words": list(params.bad_words), "allowed_token_ids": list(params.allowed_token_ids) or None,
                "use_beam_search": params.use_beam_search, "logprob_token_ids": list(params.logprob_token_ids) or None,
                "length_penalty": params.length_penalty if params.HasField("length_penalty") else 1.0}
    return oai.GenerationRequest(
        kind=kind, model=(lora.name or None) if lora is not None else None, max_tokens=params.max_tokens or None, logprobs=params.logprobs,
        top_logprobs=params.top_logprobs, return_token_ids=params.return_token_ids,
        return_tokens_as_token_ids=params.return_tokens_as_token_ids,
        cache_salt=cache_salt or None, sampling=sampling, echo=params.echo,
        chat_template=chat_options_from_pb(prompt.chat) if kind == oai.CHAT else ChatTemplateOptions(),
        prompt_options=prompt_options_from_pb(prompt),
        structured_field=(params.structured_outputs.field or None) if params.HasField("structured_outputs") else None,
        prompt=prompt.text if kind_of == "text" else (list(prompt.token_ids.ids) if kind_of == "token_ids" else None),
        messages=messages_from_pb(prompt.chat.messages) if kind == oai.CHAT else None)


def positions_to_pb(positions: list[PromptPosition]) -> list[pb.PromptLogprobs]:
    return [pb.PromptLogprobs(token_ids=[e[0] for e in p], logprobs=[e[1] for e in p if e[1] is not None],
                              ranks=[e[2] for e in p if e[2] is not None], tokens=[e[3] for e in p])
            for p in positions]


def positions_from_pb(entries: Any) -> list[PromptPosition] | None:
    if not entries:
        return None
    out: list[PromptPosition] = []
    for p in entries:
        if not p.logprobs:  # the first prompt token: nothing predicts it
            out.append([(p.token_ids[0], None, None, p.tokens[0])])
        else:
            out.append(list(zip(p.token_ids, p.logprobs, p.ranks, p.tokens)))
    return out


def delta_to_pb(d: Delta, usage: dict[str, Any] | None = None, positions: list[PromptPosition] | None = None,
                prompt_text: str = "", prompt_token_ids: list[int] | None = None) -> pb.GenerateDelta:
    """A node's output delta of choice `d.index`; `usage` (responses.usage_dict) rides on a choice's
    first one (the prompt's counts, known from then on) and its last, the prompt's logprobs, text and
    token ids (when asked for) on its first."""
    out = pb.GenerateDelta(text=d.text, token_ids=d.token_ids, finish_reason=d.finish_reason or "",
                           logprobs=d.logprobs, tokens=d.tokens or [], index=d.index, prompt_text=prompt_text,
                           prompt_token_ids=prompt_token_ids or [],
                           top_logprobs=[pb.TopLogprobs(tokens=[t for t, _ in top], logprobs=[lp for _, lp in top])
                                         for top in d.top_logprobs],
                           prompt_logprobs=positions_to_pb(positions) if positions else [])
    if usage is not None:
        out.usage.CopyFrom(pb.Usage(prompt_tokens=usage["prompt_tokens"],
                                    completion_tokens=usage["completion_tokens"],
                                    cached_tokens=usage["prompt_tokens_details"]["cached_tokens"]))
    return out


def delta_from_pb(d: pb.GenerateDelta, logprobs: bool) -> Delta:
    return Delta(d.text, list(d.token_ids), list(d.logprobs), list(d.tokens) if logprobs else None,
                 [list(zip(t.tokens, t.logprobs)) for t in d.top_logprobs], d.finish_reason or None, d.index)


def usage_from_pb(d: pb.GenerateDelta) -> dict[str, Any]:
    u = d.usage
    return usage_dict(u.prompt_tokens, u.completion_tokens, u.cached_tokens)


def tokenize_to_pb(req: TokenizeRequest) -> pb.TokenizeRequest:
    prompt = pb.Prompt(chat=chat_to_pb(req.messages, req.chat_template)) \
        if req.messages is not None else pb.Prompt(text=req.prompt)
    return pb.TokenizeRequest(prompt=prompt, add_special_tokens=req.add_special_tokens,
                              return_token_strs=req.return_token_strs)


def tokenize_from_pb(call: pb.TokenizeRequest) -> TokenizeRequest:
    chat = call.prompt.WhichOneof("kind") == "chat"
    return TokenizeRequest(model=None, prompt=None if chat else call.prompt.text,
                           messages=messages_from_pb(call.prompt.chat.messages) if chat else None,
                           add_special_tokens=call.add_special_tokens,
                           chat_template=chat_options_from_pb(call.prompt.chat) if chat else ChatTemplateOptions(),
                           return_token_strs=call.return_token_strs)


def first_token_to_pb(out: StepOutput) -> pb.FirstToken | None:
    """A prefill node's final StepOutput as the first token the decode node continues from (None
    when it sampled nothing)."""
    if not out.token_ids:
        return None
    top = out.new_top_logprobs[0] if out.new_top_logprobs else []
    return pb.FirstToken(token_id=out.token_ids[0], logprob=out.new_logprobs[0] if out.new_logprobs else None,
                         top_token_ids=[t for t, _ in top], top_logprobs=[lp for _, lp in top])


def first_token_from_pb(first: pb.FirstToken) -> FirstToken:
    from pdserve.engine.outputs import FirstToken  # the node's side: the proxy process never imports it

    return FirstToken(first.token_id, first.logprob if first.HasField("logprob") else None,
                      list(zip(first.top_token_ids, first.top_logprobs)))
