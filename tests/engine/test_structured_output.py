"""Structured outputs on the random-weight model: its free text is never JSON, its constrained text always is."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pdserve.engine.sampling_params import StructuredOutputsParams
from pdserve.engine.structured_output import check_structured_outputs
from pdserve.serving import LLM, SamplingParams

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 4}, "size": {"type": "integer", "minimum": 0, "maximum": 99},
                   "tag": {"enum": ["red", "green"]}},
    "required": ["name", "size", "tag"],
    "additionalProperties": False,
}
PROMPTS = ["Describe it:", [5, 9, 40, 41, 42]]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32")


def params(temperature: float = 0.0, max_tokens: int = 100, **spec) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=3,
                          structured_outputs=StructuredOutputsParams(**spec))


def test_free_text_is_not_json(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=40, temperature=0.0))[0]
    with pytest.raises(ValueError):
        json.loads(out.text)


def test_json_schema_output_validates(llm):
    """Compact JSON (disable_any_whitespace), greedy and sampled, for a string and a token-id prompt."""
    for temperature in (0.0, 1.0):
        for out in llm.generate(PROMPTS, params(temperature, json=SCHEMA, disable_any_whitespace=True)):
            assert out.finish_reason == "stop" and out.text.startswith('{"name":'), out.text
            jsonschema.validate(json.loads(out.text), SCHEMA)


def test_json_whitespace_is_capped(llm):
    """This model emits whitespace wherever it may: capped per gap, it still closes the object."""
    out = llm.generate(PROMPTS[0], params(0.0, 400, json=SCHEMA))[0]
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text), SCHEMA)
    assert max(len(m) for m in re.findall(r"\s+", out.text)) <= 16


def test_json_object_regex_and_choice(llm):
    out = llm.generate(PROMPTS, params(json_object=True))
    assert all(isinstance(json.loads(o.text), dict) for o in out)
    out = llm.generate(PROMPTS, params(1.0, regex=r"[a-z]{3}-\d{2}"))
    assert all(re.fullmatch(r"[a-z]{3}-\d{2}", o.text) for o in out)
    out = llm.generate(PROMPTS, params(1.0, choice=["yes", "no", "it depends"]))
    assert all(o.text in ("yes", "no", "it depends") for o in out)
    out = llm.generate(PROMPTS[0], params(grammar='root ::= "(" [0-9]+ ")"'))
    assert re.fullmatch(r"\(\d+\)", out[0].text)


def test_compiled_grammars_are_cached(llm):
    manager = llm.engine.structured_output
    spec = {**SCHEMA, "title": "cache-test"}  # a schema no other test compiled
    llm.generate(PROMPTS[0], params(json=spec, disable_any_whitespace=True))
    misses, hits = manager.cache_misses, manager.cache_hits
    llm.generate(PROMPTS, params(json=json.dumps(spec, indent=2), disable_any_whitespace=True))  # other spelling
    assert manager.cache_misses == misses and manager.cache_hits > hits


@pytest.mark.parametrize("spec,message", [
    ({"json": {"type": "nonsense"}}, "invalid JSON schema: Unsupported type"),
    ({"json": "{not json"}, "invalid JSON schema: not valid JSON"),
    ({"regex": "a(b"}, "invalid regex: .*parenthesis"),
    ({"grammar": "root ::= foo"}, "invalid grammar: .*foo"),
])
def test_invalid_specs_are_clear_value_errors(llm, spec, message):
    so = StructuredOutputsParams(**spec)
    with pytest.raises(ValueError, match=message) as tokenizer_free:
        check_structured_outputs(so)
    assert "/project/" not in str(tokenizer_free.value)  # no C++ source locations
    with pytest.raises(ValueError, match=message):
        llm.generate(PROMPTS[0], SamplingParams(structured_outputs=so))
    assert not llm.engine.has_unfinished_requests()


def test_exactly_one_kind():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
