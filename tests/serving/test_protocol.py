"""The protocol module's request parsing for vLLM's parameters and the choice bookkeeping (pure functions)."""
from __future__ import annotations

import asyncio

import pytest

from pdserve.deploy.processes import REPO
from pdserve.engine.sampling_params import BOUNDS, StructuredOutputsParams
from pdserve.serving import protocol as oai
from pdserve.serving import responses as out
from pdserve.serving.choices import Assembler, ChoiceOutput, first_delta, merge, sub_request_id


def parse(body: dict, kind: str = oai.COMPLETION) -> oai.GenerationRequest:
    return oai.parse_request(kind, body)


def refused(body: dict, param: str, kind: str = oai.COMPLETION) -> oai.APIError:
    with pytest.raises(oai.APIError) as e:
        parse(body, kind)
    assert e.value.status == 400 and e.value.param == param, e.value.message
    return e.value


def test_batched_prompts_split_one_request_per_prompt():
    req = parse({"prompt": ["a", [5, 6], "c"], "n": 2})
    subs = req.per_prompt()
    assert [s.prompt for s in subs] == ["a", [5, 6], "c"] and all(s.n == 2 for s in subs)
    assert parse({"prompt": [5, 6]}).per_prompt()[0].prompt == [5, 6]  # token ids: one prompt, not a batch
    assert [sub_request_id("r", p, 3) for p in range(3)] == ["r-0", "r-1", "r-2"] and sub_request_id("r", 0, 1) == "r"
    refused({"prompt": ["a", 5]}, "prompt")
    refused({"prompt": ["a", ""]}, "prompt")


@pytest.mark.parametrize("body,spec", [
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}}},
     StructuredOutputsParams(json={"type": "integer"})),
    ({"response_format": {"type": "text"}}, None),
    ({"guided_json": '{"type": "boolean"}'}, StructuredOutputsParams(json='{"type": "boolean"}')),
    ({"guided_regex": "[a-z]+"}, StructuredOutputsParams(regex="[a-z]+")),
    ({"guided_choice": ["x", "y"]}, StructuredOutputsParams(choice=["x", "y"])),
    ({"guided_grammar": 'root ::= "a"'}, StructuredOutputsParams(grammar='root ::= "a"')),
    ({"structured_outputs": {"regex": "b+", "disable_any_whitespace": True}},
     StructuredOutputsParams(regex="b+", disable_any_whitespace=True)),
])
def test_structured_output_fields(body, spec):
    assert parse({"prompt": "x", **body}).sampling["structured_outputs"] == spec


@pytest.mark.parametrize("body,param,message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "invalid JSON schema"),
    ({"response_format": {"type": "xml"}}, "response_format", "type must be"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"guided_regex": "a(b"}, "guided_regex", "invalid regex"),
    ({"guided_choice": []}, "guided_choice", "exactly one"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"jsonn": {}}}, "structured_outputs", "unsupported keys: jsonn"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "at most one"),
])
def test_bad_structured_outputs_are_400_naming_the_field(body, param, message):
    assert message in refused({"prompt": "x", **body}, param).message


@pytest.mark.parametrize("body,param", [
    ({"n": 0}, "n"), ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": "1"}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 200}}, "logit_bias"), ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"), ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"echo": "yes"}, "echo"), ({"best_of": 2}, "best_of"), ({"suffix": "s"}, "suffix"), ({"min_p": 2}, "min_p"),
    ({"bogus": 1}, "bogus"), ({"tools": [{"type": "function"}]}, "tools"),
])
def test_bad_values_and_unsupported_fields_are_400_naming_them(body, param):
    refused({"prompt": "x", **body}, param)


def test_value_bounds_are_the_engines_and_a_400_names_the_field_sent():
    """The HTTP layer checks JSON types; a value out of its bound is the engine's SamplingParamsError,
    raised while parsing (so pd-proxy refuses it too) and answered as a 400 naming the request's field."""
    for body in ({"repetition_penalty": 3}, {"repetition_penalty": 100.5}, {"temperature": 2}):
        parse({"prompt": "x", **body})  # vLLM's bounds: repetition_penalty was at most 2 here
    for body, param, message in [
        ({"temperature": 2.5}, "temperature", "temperature must be in [0.0, 2.0], got 2.5"),
        ({"repetition_penalty": 0}, "repetition_penalty", "repetition_penalty must be > 0.0, got 0"),
        ({"top_k": -2}, "top_k", "top_k must be in [-1, 2147483647], got -2"),
        ({"n": 129}, "n", "n must be in [1, 128], got 129"),
        ({"logprobs": 21}, "logprobs", "logprobs must be in [0, 20], got 21"),  # the engine's top_logprobs
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens", "min_tokens (20) must not exceed max_tokens (10)"),
        ({"logprob_token_ids": [1]}, "logprob_token_ids", "logprob_token_ids requires logprobs"),
        ({"stop": [""]}, "stop", "stop must be a non-empty string or a list of non-empty strings"),
        ({"allowed_token_ids": []}, "allowed_token_ids", "allowed_token_ids must be a non-empty list"),
        ({"seed": 2**63 - 1, "n": 2}, "seed", "seed must be in [-9223372036854775808, 9223372036854775806]"),
        ({"use_beam_search": True, "n": 2, "logprobs": 1}, "logprobs", "logprobs is not supported with use_beam"),
    ]:
        assert refused({"prompt": "x", **body}, param).message.startswith(message)
    chat = {"messages": [{"role": "user", "content": "x"}]}
    assert refused({**chat, "max_completion_tokens": 0}, "max_completion_tokens", oai.CHAT).message == \
        "max_completion_tokens must be in [1, 2147483647], got 0"
    refused({**chat, "max_completion_tokens": 0, "max_tokens": 5}, "max_completion_tokens", oai.CHAT)
    refused({**chat, "logprobs": True, "top_logprobs": 21}, "top_logprobs", oai.CHAT)
    for body, param in [({"temperature": "1"}, "temperature"), ({"n": 1.5}, "n"), ({"stop_token_ids": ["a"]},
                                                                                    "stop_token_ids")]:
        assert "must be a" in refused({"prompt": "x", **body}, param).message  # types: the HTTP layer's


def test_a_node_names_the_field_of_a_token_id_outside_its_vocabulary():
    req = parse({"prompt": "x", "logprobs": 1, "logprob_token_ids": [5, 70]})
    with pytest.raises(oai.APIError) as e:
        req.sampling_params(1, 100, vocab_size=64)
    assert e.value.param == "logprob_token_ids" and "token id 70 is outside the vocabulary [0, 64)" in e.value.message
    assert req.sampling_params(1, 100).logprob_token_ids == [5, 70]  # the proxy knows no vocabulary


def test_the_docs_table_of_value_bounds_is_the_engines():
    section = (REPO / "docs" / "vllm-compat.md").read_text().split("## Value bounds", 1)[1].split("\n## ", 1)[0]
    lines = section.splitlines()
    rows = [line for line in lines if line.startswith("| `")]
    assert rows == [f"| `{name}` | {bound} |" for name, bound in BOUNDS.items()]


def test_messages_are_read_as_vllm_reads_them():
    """Any role reaches the chat template; keys beyond role, content and name are ignored (as vLLM ignores
    them) except tool calls, which this server cannot render; content parts must be text."""
    assert parse({"messages": [{"role": "user", "content": "x", "name": "ann"}]}, oai.CHAT).messages == \
        [{"role": "user", "content": "x", "name": "ann"}]
    assert parse({"messages": [{"role": "user", "content": "x", "audio": {"id": "a"}, "id": 7}]},
                 oai.CHAT).messages == [{"role": "user", "content": "x"}]
    assert parse({"messages": [{"role": "narrator", "content": "once"}]}, oai.CHAT).messages[0]["role"] == "narrator"
    e = refused({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "t"}]}]}, "messages",
                oai.CHAT)
    assert "messages[0].tool_calls" in e.message and e.code == "unsupported_parameter"
    replayed = {"role": "assistant", "content": None, "refusal": None, "tool_calls": None, "annotations": []}
    assert parse({"messages": [replayed]}, oai.CHAT).messages == [{"role": "assistant", "content": ""}]
    image = {"type": "image_url", "image_url": {"url": "http://x"}}
    assert "image_url" in refused({"messages": [{"role": "user", "content": [image]}]}, "messages", oai.CHAT).message
    for bad in ({"content": "x"}, {"role": "", "content": "x"}, {"role": 3, "content": "x"}):
        refused({"messages": [bad]}, "messages", oai.CHAT)


def test_a_stream_cut_short_counts_what_it_sent():
    req = parse({"prompt": ["p0", "p1"], "n": 2, "stream": True})
    assembler = Assembler(req, 2)
    assembler.delta(ChoiceOutput(0, out.Delta("ab", [1, 2]), lambda: "", lambda: None, prompt_tokens=(5, 1)))
    assembler.delta(ChoiceOutput(0, out.Delta("c", [3], index=1, finish_reason="stop"), lambda: "", lambda: None,
                                 usage=out.usage_dict(5, 1, 1)))
    assembler.delta(ChoiceOutput(1, out.Delta("d", [4]), lambda: "", lambda: None, prompt_tokens=(7, 0)))
    assert assembler.unfinished == [0, 2, 3]
    assert assembler.usage() == out.usage_dict(12, 4, 1)  # both prompts, every token sent


def test_neutral_values_of_unsupported_features_pass():
    req = parse({"messages": [{"role": "user", "content": "x"}], "tools": [], "tool_choice": "none", "store": False,
                 "service_tier": "auto", "parallel_tool_calls": True, "best_of": None}, oai.CHAT)
    assert req.kind == oai.CHAT


def test_echo_with_logprobs_asks_the_engine_for_prompt_logprobs():
    req = parse({"prompt": "x", "echo": True, "logprobs": 3})
    assert req.sampling["prompt_logprobs"] == 3 and req.prompt_logprobs is None
    both = parse({"prompt": "x", "echo": True, "logprobs": 1, "prompt_logprobs": 4})
    assert both.sampling["prompt_logprobs"] == 4 and both.prompt_logprobs == 4
    assert parse({"prompt": "x", "echo": True}).sampling["prompt_logprobs"] is None


POSITIONS = [[(7, None, None, "a")], [(8, -0.5, 2, "b"), (9, -0.2, 1, "c")], [(4, -1.5, 3, "d"), (2, -0.1, 1, "e"),
                                                                         (3, -0.9, 2, "f")]]


def test_prompt_logprobs_json_and_echo_delta():
    assert out.prompt_logprobs_json(POSITIONS, 1) == [
        None, {"8": {"logprob": -0.5, "rank": 2, "decoded_token": "b"},
               "9": {"logprob": -0.2, "rank": 1, "decoded_token": "c"}},
        {"4": {"logprob": -1.5, "rank": 3, "decoded_token": "d"}, "2": {"logprob": -0.1, "rank": 1, "decoded_token": "e"}}]
    d = out.echo_delta("abd", POSITIONS, 2)
    assert (d.text, d.tokens, d.logprobs) == ("abd", ["a", "b", "d"], [None, -0.5, -1.5])
    assert d.top_logprobs == [None, [("c", -0.2), ("b", -0.5)], [("e", -0.1), ("f", -0.9)]]
    assert out.echo_delta("abd", None, 2) == out.Delta("abd")


def test_first_delta_and_choices_usage():
    req = parse({"prompt": ["p0", "p1"], "n": 2, "echo": True, "logprobs": 1})
    d = first_delta(req, out.Delta("X", [11], [-0.3], ["X"], [[("X", -0.3)]], index=3), lambda: "abd", lambda: POSITIONS)
    assert d.index == 3 and d.text == "abdX" and d.logprobs == [None, -0.5, -1.5, -0.3] and d.token_ids == [11]
    assembler = Assembler(req, 2)
    for index in range(4):
        p, i = divmod(index, 2)
        got = assembler.add(ChoiceOutput(p, out.Delta("a", [1], index=i), lambda: f"p{p}", lambda: None))
        assert got.index == index and got.text == f"p{p}a"  # echoed before the first output
        usage = out.usage_dict(10 + p, 2, 4)
        assembler.add(ChoiceOutput(p, out.Delta("b", [2], index=i, finish_reason="stop"), lambda: "", lambda: None,
                                   usage=usage))
        assert assembler.unfinished == list(range(index + 1, 4))
    assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in assembler.all()] == [
        (i, f"p{i // 2}ab", [1, 2], "stop") for i in range(4)]
    assert assembler.usage() == out.usage_dict(21, 8, 8)  # each prompt counted once
    chat = parse({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "The"}],
                  "echo": True}, oai.CHAT)
    assert first_delta(chat, out.Delta(" end"), lambda: "", lambda: None).text == "The end"


def test_merge_interleaves_and_stops_every_stream_on_error():
    async def stream(name: str, n: int, fail: bool = False):
        for i in range(n):
            await asyncio.sleep(0.001)
            yield f"{name}{i}"
        if fail:
            raise ValueError(name)

    async def collect(*streams):
        return [item async for item in merge(list(streams))]

    got = asyncio.run(collect(stream("a", 3), stream("b", 3)))
    assert sorted(got) == [(0, "a0"), (0, "a1"), (0, "a2"), (1, "b0"), (1, "b1"), (1, "b2")]
    assert [k for k, _ in got] != [0, 0, 0, 1, 1, 1]
    with pytest.raises(ValueError, match="b"):
        asyncio.run(collect(stream("a", 50), stream("b", 1, fail=True)))


def test_vllm_prompt_and_chat_template_fields():
    from pdserve.serving.protocol_prompt import PromptOptions

    chat = parse({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                  "continue_final_message": True, "add_generation_prompt": False,
                  "chat_template_kwargs": {"enable_thinking": False}}, oai.CHAT)
    assert chat.chat_template.kwargs == {"enable_thinking": False} and chat.chat_template.continue_final_message
    assert chat.chat_template.response_role(chat.messages) == "assistant"  # the continued message's role
    assert parse({"messages": [{"role": "user", "content": "q"}], "add_generation_prompt": False},
                 oai.CHAT).chat_template.response_role([{"role": "user", "content": "q"}]) == "user"
    refused({"messages": [{"role": "user", "content": "q"}], "continue_final_message": True},
            "continue_final_message", oai.CHAT)
    refused({"messages": [{"role": "user", "content": "q"}], "chat_template_kwargs": {"tokenize": True}},
            "chat_template_kwargs", oai.CHAT)
    refused({"prompt": "x", "continue_final_message": True}, "continue_final_message")  # a chat field
    options = parse({"prompt": "x", "truncate_prompt_tokens": 3, "add_special_tokens": False}).prompt_options
    assert options == PromptOptions(False, 3, "left")
    assert options.truncate([1, 2, 3, 4, 5], 100, 10) == [3, 4, 5] and options.truncate([1, 2], 100, 10) == [1, 2]
    assert PromptOptions(truncate_prompt_tokens=2, truncation_side="right").truncate([1, 2, 3], 100, 10) == [1, 2]
    assert PromptOptions(truncate_prompt_tokens=-1).truncate(list(range(20)), 12, 4) == list(range(12, 20))
    with pytest.raises(oai.APIError) as e:
        PromptOptions(truncate_prompt_tokens=9).truncate([1], 12, 4)
    assert e.value.param == "truncate_prompt_tokens"
    for body, param in (({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
                        ({"truncation_side": "up"}, "truncation_side"),
                        ({"add_special_tokens": 1}, "add_special_tokens"),
                        ({"request_id": "has space"}, "request_id"), ({"priority": 2**63}, "priority"),
                        ({"bad_words": "ab"}, "bad_words"), ({"allowed_token_ids": []}, "allowed_token_ids")):
        refused({"prompt": "x", **body}, param)


def test_request_id_rule():
    req = parse({"prompt": "x", "request_id": "mine", "priority": -3})
    assert req.priority == -3
    assert oai.request_id_of(req, None, "made") == "mine"
    assert oai.request_id_of(req, "hdr", "hdr") == "hdr"  # the header wins, as in vLLM
    assert oai.request_id_of(parse({"prompt": "x"}), None, "made") == "made"
