"""vLLM's /tokenize, /detokenize and /version endpoints: requests, the tokenizer work, responses.

/tokenize takes a completions-style {"prompt"} or a chat-style {"messages"} body and answers
{"count", "max_model_len", "tokens", "token_strs"}; a prompt tokenizes exactly as
/v1/completions and /v1/chat/completions tokenize it with the same fields (`encode` is that one
rule: chat template options, add_special_tokens). /detokenize takes {"tokens"} and answers
{"prompt"}. Nodes answer them with their tokenizer; the proxy asks a node over gRPC.
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata
from typing import Any

from pdserve.serving.protocol_chat import (CHAT_TEMPLATE_FIELDS, ChatTemplateOptions, parse_chat_template_options,
                                           parse_messages)
from pdserve.serving.protocol_fields import bad_request, decode_json_body

_TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens", "return_token_strs", *CHAT_TEMPLATE_FIELDS}


@dataclass
class TokenizeRequest:
    model: str | None
    prompt: str | None  # completions style
    messages: list[dict[str, str]] | None  # chat style
    add_special_tokens: bool
    chat_template: ChatTemplateOptions = ChatTemplateOptions()
    return_token_strs: bool = False


def _model(body: dict) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("model must be a string", "model")
    return model


def _flag(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"{name} must be a boolean", name)
    return v


def parse_tokenize(raw: bytes | str | Any) -> TokenizeRequest:
    body = decode_json_body(raw)
    unknown = sorted(set(body) - _TOKENIZE_FIELDS)
    if unknown:
        raise bad_request(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0], "unsupported_parameter")
    chat = body.get("messages") is not None
    if chat == (body.get("prompt") is not None):
        raise bad_request("give either prompt (a string) or messages", "prompt")
    prompt = None if chat else body["prompt"]
    if not chat and not isinstance(prompt, str):
        raise bad_request("prompt must be a string", "prompt")
    return TokenizeRequest(model=_model(body), prompt=prompt, messages=parse_messages(body) if chat else None,
                           add_special_tokens=_flag(body, "add_special_tokens", not chat),
                           chat_template=parse_chat_template_options(body) if chat else ChatTemplateOptions(),
                           return_token_strs=_flag(body, "return_token_strs", False))


def parse_detokenize(raw: bytes | str | Any) -> tuple[str | None, list[int]]:
    """(model, token ids)."""
    body = decode_json_body(raw)
    unknown = sorted(set(body) - {"model", "tokens"})
    if unknown:
        raise bad_request(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0], "unsupported_parameter")
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                               for t in tokens):
        raise bad_request("tokens must be a list of non-negative token ids", "tokens")
    return _model(body), tokens


def encode(tokenizer: Any, prompt: str | None, messages: list[dict[str, str]] | None, chat: ChatTemplateOptions,
           add_special_tokens: bool | None) -> list[int]:
    """A text or chat prompt's token ids, as every endpoint computes them (400 when the chat template
    refuses the messages). `add_special_tokens` None: the endpoint's default (true for text, false
    for chat: the template holds what the model wants)."""
    from pdserve.engine.tokenizer import apply_chat_template, encode_prompt

    if messages is not None:
        try:
            return apply_chat_template(tokenizer, messages, chat.add_generation_prompt,
                                       continue_final_message=chat.continue_final_message,
                                       chat_template_kwargs=chat.kwargs, add_special_tokens=bool(add_special_tokens))
        except ValueError as e:
            raise bad_request(str(e), "messages") from None
    return encode_prompt(tokenizer, prompt, add_special_tokens is not False)


def tokenize(tokenizer: Any, req: TokenizeRequest) -> list[int]:
    return encode(tokenizer, req.prompt, req.messages, req.chat_template, req.add_special_tokens)


def detokenize(tokenizer: Any, token_ids: list[int], vocab_size: int) -> str:
    bad = [t for t in token_ids if t >= vocab_size]
    if bad:
        raise bad_request(f"token ids must be below the vocabulary size {vocab_size}; got {bad[0]}", "tokens")
    return tokenizer.decode(token_ids)


def tokenize_response(token_ids: list[int], max_model_len: int, token_strs: list[str] | None) -> dict[str, Any]:
    return {"count": len(token_ids), "max_model_len": max_model_len, "tokens": token_ids, "token_strs": token_strs}


def tokenize_reply(tokenizer: Any, req: TokenizeRequest, max_model_len: int) -> dict[str, Any]:
    """The /tokenize answer of a node (its gRPC Tokenize carries the same fields)."""
    ids = tokenize(tokenizer, req)
    strs = [str(t) for t in tokenizer.convert_ids_to_tokens(ids)] if req.return_token_strs else None
    return tokenize_response(ids, max_model_len, strs)


def detokenize_response(text: str) -> dict[str, Any]:
    return {"prompt": text}


def version_response() -> dict[str, Any]:
    try:
        version = metadata.version("pdserve")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return {"version": version}
