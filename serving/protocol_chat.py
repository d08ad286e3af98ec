"""Chat request fields: the messages and how the chat template renders them (vLLM's rules).

A message is handed to the chat template as vLLM hands it: any role (the template decides what a
custom role means), its text content and participant name; other keys are ignored, as vLLM
ignores them, except tool calls, which this server cannot render (it serves no tools).
`add_generation_prompt`, `continue_final_message` and `chat_template_kwargs` change the prompt,
so pd-serve, both P/D nodes and the proxy read them here alike (serving/wire.py carries them).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pdserve.serving.protocol_fields import bad_request, bool_field

CHAT_TEMPLATE_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")
# Message keys carrying content the template would render but this server cannot (no tools served).
_UNRENDERABLE = ("tool_calls", "function_call")
# chat_template_kwargs keys that would replace an argument of the template call itself instead of
# reaching the template as a variable; the request's own fields set the two flags.
_RESERVED_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "tokenize", "return_dict", "padding",
    "truncation", "max_length", "return_tensors", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "add_generation_prompt", "continue_final_message"})


@dataclass(frozen=True)
class ChatTemplateOptions:
    """How the chat template renders the messages (vLLM's request fields of the same names)."""

    add_generation_prompt: bool = True  # open a new assistant message after the conversation
    continue_final_message: bool = False  # leave the last message open: the model continues it
    kwargs: dict[str, Any] | None = None  # chat_template_kwargs: extra template variables (JSON values)

    def response_role(self, messages: list[dict[str, str]]) -> str:
        """The role of the answer (vLLM's): the assistant's when a generation prompt opens a new
        message, else the role of the last message, which the model continues."""
        return "assistant" if self.add_generation_prompt or not messages else messages[-1]["role"]

    def kwargs_json(self) -> str:
        return json.dumps(self.kwargs) if self.kwargs else ""


def parse_chat_template_options(body: dict) -> ChatTemplateOptions:
    """The three fields; both flags true is a 400 as in vLLM (add_generation_prompt defaults to true,
    so continue_final_message needs add_generation_prompt=false beside it)."""
    continue_final = bool_field(body, "continue_final_message")
    add_generation = bool_field(body, "add_generation_prompt", True)
    if continue_final and add_generation:
        raise bad_request("Cannot set both continue_final_message and add_generation_prompt to true "
                          "(add_generation_prompt defaults to true: send it as false to continue the final "
                          "message)", "continue_final_message")
    return ChatTemplateOptions(add_generation, continue_final, parse_template_kwargs(body.get("chat_template_kwargs")))


def parse_template_kwargs(kwargs: Any) -> dict[str, Any] | None:
    if kwargs is None:
        return None
    if not isinstance(kwargs, dict):
        raise bad_request("chat_template_kwargs must be an object", "chat_template_kwargs")
    reserved = sorted(_RESERVED_KWARGS & kwargs.keys())
    if reserved:
        raise bad_request(f"chat_template_kwargs.{reserved[0]} is not a template variable: set the request's own "
                          "field instead", "chat_template_kwargs")
    return dict(kwargs) or None


def _content_text(content: Any, i: int) -> str:
    if content is None:  # an assistant turn that only called tools, replayed: nothing to render
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(c, dict) for c in content):
        kinds = {c.get("type") for c in content} - {"text"}
        if kinds:
            raise bad_request(f"messages[{i}].content has {sorted(map(str, kinds))[0]} parts: this server "
                              "takes text only", "messages", "unsupported_parameter")
        if all(isinstance(c.get("text"), str) for c in content):
            return "".join(c["text"] for c in content)
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts", "messages")


def parse_messages(body: dict) -> list[dict[str, str]]:
    """The chat messages as the template gets them: {"role", "content"[, "name"]} each."""
    msgs = body.get("messages")
    if msgs is None:
        raise bad_request("messages is required", "messages", "missing_required_parameter")
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
            raise bad_request(f"messages[{i}] must be an object with a role (a non-empty string)", "messages")
        for key in _UNRENDERABLE:
            if m.get(key) not in (None, [], ""):
                raise bad_request(f"messages[{i}].{key} is not supported by this server (it serves no tools)",
                                  "messages", "unsupported_parameter")
        message = {"role": m["role"], "content": _content_text(m.get("content"), i)}
        name = m.get("name")
        if name not in (None, ""):  # OpenAI's participant name: the chat template may render it
            if not isinstance(name, str):
                raise bad_request(f"messages[{i}].name must be a string", "messages")
            message["name"] = name
        out.append(message)
    return out
