"""The request fields that ask for structured outputs, turned into the engine's StructuredOutputsParams.

OpenAI's `response_format` ({"type": "json_object"} / {"type": "json_schema", "json_schema":
{"schema": ...}}) and vLLM's `structured_outputs` object and older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` fields all land here. At most one may be
given. Nodes check the grammar (xgrammar, without a tokenizer) before anything runs; the proxy
leaves that to its nodes (xgrammar would load torch into it) and carries the field's name over
gRPC, so an invalid schema is the same 400 from the proxy as from pd-serve.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable

from pdserve.engine.sampling_params import StructuredOutputsParams

FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
_SPEC_KEYS = {f.name for f in dataclasses.fields(StructuredOutputsParams)}


def _response_format(v: Any, bad: Callable[[str], Exception]) -> StructuredOutputsParams | None:
    if not isinstance(v, dict) or not isinstance(v.get("type"), str):
        raise bad('response_format must be an object with a "type"')
    kind = v["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = v.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, (dict, str)):
            raise bad('response_format json_schema needs "json_schema": {"name": ..., "schema": {...}}')
        return StructuredOutputsParams(json=schema)
    raise bad(f'response_format type must be "text", "json_object" or "json_schema", got {json.dumps(kind)}')


def _structured_outputs(v: Any, bad: Callable[[str], Exception]) -> StructuredOutputsParams:
    if not isinstance(v, dict):
        raise bad("structured_outputs must be an object with one of json, regex, choice, grammar, json_object")
    unknown = sorted(set(v) - _SPEC_KEYS)
    if unknown:
        raise bad(f"structured_outputs has unsupported keys: {', '.join(unknown)}")
    return StructuredOutputsParams(**{k: x for k, x in v.items() if x is not None})


def parse_structured_outputs(body: dict[str, Any], bad_request: Callable[..., Exception],
                             check: bool = True) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the spec or None, the field it came from); `bad_request(message, param)` builds the 400.
    With `check` the grammar is compiled (tokenizer-free) too."""
    given = [f for f in FIELDS if body.get(f) is not None]
    if len(given) > 1:
        raise bad_request(f"give at most one of {', '.join(FIELDS)}; got {', '.join(given)}", given[1])
    if not given:
        return None, None
    name = given[0]
    v = body[name]

    def bad(message: str) -> Exception:
        return bad_request(message, name)

    try:
        if name == "response_format":
            spec = _response_format(v, bad)
        elif name == "structured_outputs":
            spec = _structured_outputs(v, bad)
        elif name == "guided_json":
            spec = StructuredOutputsParams(json=v)
        elif name == "guided_regex":
            spec = StructuredOutputsParams(regex=v)
        elif name == "guided_choice":
            spec = StructuredOutputsParams(choice=v)
        else:
            spec = StructuredOutputsParams(grammar=v)
        if spec is not None and check:
            from pdserve.engine.structured_output import check_structured_outputs

            check_structured_outputs(spec)
    except (ValueError, TypeError) as e:
        raise bad(str(e)) from None
    return spec, name
