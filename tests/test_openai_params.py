"""Every parameter of the `openai` client's completions.create and chat.completions.create is either
honoured (the request succeeds) or refused with a 400 naming it — never silently ignored. The
tables are serving.protocol's; a parameter a newer client adds fails this test until it is placed."""
from __future__ import annotations

import inspect

import openai
import pytest
from openai.resources.chat.completions import Completions as ChatCompletions
from openai.resources.completions import Completions

from serving.protocol import CHAT, COMPLETION, NEUTRAL_PARAMETERS, SUPPORTED_PARAMETERS
from tests.serve_helpers import ServerProcess

TRANSPORT = {"self", "extra_headers", "extra_query", "extra_body", "timeout"}
SCHEMA = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"], "additionalProperties": False}
# A value each honoured parameter is sent with (the request must succeed)...
HONOURED = {
    "best_of": 1, "echo": True, "frequency_penalty": 0.5, "logit_bias": {"70": 2.0}, "logprobs": 2, "max_tokens": 3,
    "n": 2, "presence_penalty": 0.5, "seed": 3, "stop": ["\n"], "stream": False, "stream_options": None,
    "suffix": None, "temperature": 0.7, "top_p": 0.9, "user": "u-1", "max_completion_tokens": 3,
    "top_logprobs": 2, "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}},
    "safety_identifier": "s-1", "store": False, "metadata": {}, "modalities": ["text"], "tools": [],
    "tool_choice": "none", "functions": [], "function_call": "none", "parallel_tool_calls": True,
    "service_tier": "auto",
}
HONOURED_CHAT = {**HONOURED, "logprobs": True}
WITH = {"top_logprobs": {"logprobs": True}}  # what a parameter needs beside it
# ... and a value that asks for a feature this server does not have (must be a 400 naming it).
REFUSED = {
    "best_of": 3, "suffix": "tail", "audio": {"voice": "alloy", "format": "wav"}, "function_call": "auto",
    "functions": [{"name": "f", "parameters": {}}], "metadata": {"k": "v"}, "modalities": ["text", "audio"],
    "moderation": {"mode": "block"}, "parallel_tool_calls": "maybe", "prediction": {"type": "content", "content": "x"},
    "prompt_cache_key": "k", "prompt_cache_options": {"x": 1}, "prompt_cache_retention": "24h",
    "reasoning_effort": "low", "service_tier": "flex", "store": True,
    "tool_choice": "auto", "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    "verbosity": "low", "web_search_options": {},
}


@pytest.fixture(scope="module")
def api(tiny_llama):
    with ServerProcess("--model", str(tiny_llama), "--dtype", "float32", "--kv-cache-memory", "16MiB") as srv:
        oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        yield oai, oai.models.list().data[0].id


def params_of(method) -> list[str]:
    return [p for p in inspect.signature(method).parameters if p not in TRANSPORT]


@pytest.mark.parametrize("kind,method", [(COMPLETION, Completions.create), (CHAT, ChatCompletions.create)])
def test_every_client_parameter_is_honoured_or_refused_by_name(api, kind, method):
    oai, model = api
    base = {"model": model, "prompt": "Hi"} if kind == COMPLETION else \
        {"model": model, "messages": [{"role": "user", "content": "Hi"}]}
    create = oai.completions.create if kind == COMPLETION else oai.chat.completions.create
    for name in params_of(method):
        if name in base:
            continue
        supported, neutral = name in SUPPORTED_PARAMETERS[kind], name in NEUTRAL_PARAMETERS
        assert supported or neutral, f"{kind}: the openai client's {name!r} is in neither table"
        if supported or name in HONOURED:
            value = (HONOURED if kind == COMPLETION else HONOURED_CHAT)[name]
            extra = {"max_tokens": 3} if name not in ("max_tokens", "max_completion_tokens", "response_format") else {}
            create(**base, **extra, **WITH.get(name, {}), **{name: value})  # honoured: no error
        if not supported:
            with pytest.raises(openai.BadRequestError) as refused:
                create(**base, max_tokens=3, **{name: REFUSED[name]})
            assert refused.value.body["param"] == name and name in refused.value.body["message"]


def test_unknown_fields_are_refused_by_name(api):
    oai, model = api
    with pytest.raises(openai.BadRequestError) as refused:
        oai.completions.create(model=model, prompt="Hi", max_tokens=2, extra_body={"temprature": 0.5})
    assert refused.value.body["param"] == "temprature" and refused.value.body["code"] == "unsupported_parameter"
