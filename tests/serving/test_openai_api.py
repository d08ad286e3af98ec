"""The OpenAI API that vLLM users send, with the `openai` client, through pd-serve, through pd-proxy over
P/D with a file store (decode samples everything) and on each P/D node's own HTTP port: batched
prompts, n, streams that interleave choices, echo, prompt_logprobs, penalties and logit_bias,
structured outputs, vLLM's stop/min_tokens extras, /tokenize /detokenize /version, and every
parameter of the client's create() honoured or refused by name. Greedy outputs stay token-identical
to HF where nothing reshapes the logits; penalties and logit_bias match a reference over HF's logits."""
from __future__ import annotations

import inspect
import json
import re
from dataclasses import dataclass
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import torch
from openai.resources.chat.completions import Completions as ChatCompletions
from openai.resources.completions import Completions

from pdserve.deploy.processes import MAX_MODEL_LEN, NODE_ARGS
from pdserve.deploy.server_process import ServerProcess
from pdserve.serving import LLM, SamplingParams
from pdserve.serving.protocol import CHAT, COMPLETION, NEUTRAL_PARAMETERS, SUPPORTED_PARAMETERS
from tests.helpers.cluster import client, extra_proxy, log_lines, start_cluster
from tests.helpers.oracles import hf_greedy
from tests.helpers.prompts import random_prompt
from tests.helpers.prompts import adjacent_letters
from tests.helpers.oracles import reference_penalties

pytestmark = pytest.mark.slow

PROMPTS = [random_prompt(n, seed=900 + n) for n in (20, 37)]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4},
                                           "size": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["name", "size"], "additionalProperties": False}


KINDS = ["pd-serve", "proxy", "prefill-node", "decode-node"]


@dataclass
class API:
    kind: str  # one of KINDS
    url: str
    oai: openai.OpenAI
    model: str
    engine_stats_url: str  # the node that samples: pd-serve itself, or the decode node
    decode_log: Any = None
    proxy_pid: int | None = None

    def stats(self) -> dict:
        return httpx.get(self.engine_stats_url + "/stats", timeout=10).json()

    def post(self, path: str, body: Any) -> tuple[int, Any]:
        r = httpx.post(self.url + path, json=body, timeout=120)
        return r.status_code, r.json()


@pytest.fixture(scope="module")
def pd_serve(tiny_llama):
    engine_args = NODE_ARGS[:NODE_ARGS.index("--chunk-size")]
    with ServerProcess("--model", str(tiny_llama), *engine_args) as srv:
        yield srv


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory):
    c = start_cluster(tiny_llama, tmp_path_factory.mktemp("cluster-openai"), store="file")
    yield c
    c.stop()


@pytest.fixture(scope="module", params=KINDS)
def api(request, pd_serve, cluster) -> API:
    decode = cluster.decode[0]
    node = {"prefill-node": cluster.prefill[0], "decode-node": decode}.get(request.param)
    if request.param == "pd-serve":
        url, stats_url, log = pd_serve.url, pd_serve.url, None
    elif request.param == "proxy":
        url, stats_url, log = cluster.url, f"http://127.0.0.1:{decode.http_port}", decode.log_file
    else:  # a node's own OpenAI server: the same API, with its own engine and connector
        url = stats_url = f"http://127.0.0.1:{node.http_port}"
        log = None
    oai = client(url)
    return API(request.param, url, oai, oai.models.list().data[0].id, stats_url, log,
               cluster.proxy.proc.pid if request.param == "proxy" else None)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32", kv_cache_memory="16MiB")


@pytest.fixture(scope="module")
def hf_refs(tiny_llama):
    return hf_greedy(tiny_llama, PROMPTS, 8)


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()


def ids_of(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def test_batched_prompts_times_n_greedy_match_hf(api, hf_refs):
    resp = api.oai.completions.create(model=api.model, prompt=PROMPTS, n=2, max_tokens=8, temperature=0,
                                      extra_body={"return_token_ids": True})
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert [ids_of(c) for c in resp.choices] == [hf_refs[0], hf_refs[0], hf_refs[1], hf_refs[1]]
    assert resp.usage.prompt_tokens == sum(map(len, PROMPTS))  # each prompt counted once, not n times
    assert resp.usage.completion_tokens == 2 * sum(map(len, hf_refs))
    texts = api.oai.completions.create(model=api.model, prompt=["Hello", "World"], max_tokens=4, temperature=0)
    assert [c.index for c in texts.choices] == [0, 1] and texts.choices[0].text != texts.choices[1].text


def test_n_shares_the_prompt_and_streams_interleaved(api, llm):
    prompt = random_prompt(45, seed=77 + KINDS.index(api.kind))  # new to every engine and to the store
    before = api.stats()
    resp = api.oai.completions.create(model=api.model, prompt=prompt, n=3, max_tokens=6, temperature=1.0, seed=5,
                                      extra_body={"return_token_ids": True, "ignore_eos": True},
                                      extra_headers={"X-Request-Id": f"{api.kind}-n3"})
    after = api.stats()
    # The prompt is computed once: all of it on one engine; on P/D decode computes only its last token.
    computed = after["num_prompt_tokens_computed"] - before["num_prompt_tokens_computed"]
    assert computed == (1 if api.kind == "proxy" else len(prompt))
    if api.decode_log is not None:  # ... and loads it from the store once
        assert len([x for x in log_lines(api.decode_log, f"{api.kind}-n3") if "Retrieved" in x]) == 1
    offline = llm.generate([prompt], SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=5, ignore_eos=True))
    assert [ids_of(c) for c in resp.choices] == [o.token_ids for o in offline[0].outputs]
    chunks = list(api.oai.completions.create(model=api.model, prompt=prompt, n=3, max_tokens=6, temperature=1.0,
                                             seed=5, stream=True, extra_body={"ignore_eos": True}))
    order = [c.choices[0].index for c in chunks if c.choices]
    assert set(order) == {0, 1, 2} and order != sorted(order)  # interleaved, as OpenAI streams them
    for i in range(3):
        assert "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) == \
            resp.choices[i].text


def by_index(chunks: list, text: Any) -> dict[int, str]:
    out: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk.choices:
            out[c.index] = out.get(c.index, "") + (text(c) or "")
    return out


def counts(usage) -> tuple[int, int, int]:
    """Usage without cached_tokens (a repeated prompt hits the prefix cache)."""
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


def test_streams_open_count_and_close_every_choice(api):
    """Chat: a role chunk per choice first; completions: batched prompts x n with echo; both with the
    usage chunk last, equal to the whole response's usage (each prompt once, every choice's tokens)."""
    chat = dict(model=api.model, messages=[{"role": "user", "content": "two"}], n=2, max_tokens=5, seed=11,
                temperature=1.0)
    whole = api.oai.chat.completions.create(**chat)
    chunks = list(api.oai.chat.completions.create(**chat, stream=True, stream_options={"include_usage": True}))
    assert [(c.choices[0].index, c.choices[0].delta.role) for c in chunks[:2]] == [(0, "assistant"), (1, "assistant")]
    assert by_index(chunks, lambda c: c.delta.content) == {c.index: c.message.content for c in whole.choices}
    assert {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices and
            c.choices[0].finish_reason} == {c.index: c.finish_reason for c in whole.choices}
    assert chunks[-1].choices == [] and counts(chunks[-1].usage) == counts(whole.usage)
    assert all(c.usage is None for c in chunks[:-1])
    text = dict(model=api.model, prompt=["Once", "Twice upon"], n=2, max_tokens=4, seed=3, temperature=1.0,
                echo=True)
    whole = api.oai.completions.create(**text)
    chunks = list(api.oai.completions.create(**text, stream=True, stream_options={"include_usage": True}))
    assert by_index(chunks, lambda c: c.text) == {c.index: c.text for c in whole.choices}
    assert [whole.choices[i].text.startswith(p) for i, p in enumerate(["Once"] * 2 + ["Twice upon"] * 2)] == [True] * 4
    assert counts(chunks[-1].usage) == counts(whole.usage) and whole.usage.prompt_tokens == len("OnceTwice upon")


def test_continuous_usage_stats_count_every_chunk(api):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries its choice's usage so far (the
    role chunks none of the output yet), and the closing usage chunk is the whole response's."""
    body = dict(model=api.model, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}, stream=True,
                stream_options={"include_usage": True, "continuous_usage_stats": True})
    chat = list(api.oai.chat.completions.create(messages=[{"role": "user", "content": "count"}], n=2, **body))
    text = list(api.oai.completions.create(prompt="count with me", **body))
    for chunks in (chat, text):
        final = chunks[-1].usage
        choices = {c.choices[0].index for c in chunks[:-1]}
        assert chunks[-1].choices == [] and final.completion_tokens == 6 * len(choices)
        seen: dict[int, list[int]] = {}
        for c in chunks[:-1]:
            assert (c.usage.prompt_tokens, c.usage.total_tokens) == (final.prompt_tokens,
                                                                     final.prompt_tokens + c.usage.completion_tokens)
            seen.setdefault(c.choices[0].index, []).append(c.usage.completion_tokens)
        for counts_so_far in seen.values():  # grows with the output, to the choice's whole output
            assert counts_so_far == sorted(counts_so_far) and counts_so_far[-1] == 6 and len(set(counts_so_far)) >= 3
    assert [counts_so_far[0] for counts_so_far in by_choice(chat).values()] == [0, 0]  # the role chunks
    # Without it (or without include_usage, as in vLLM) the chunks' usage stays null.
    plain = list(api.oai.completions.create(prompt="count",
                                            **{**body, "stream_options": {"continuous_usage_stats": True}}))
    assert all(c.usage is None for c in plain)


def by_choice(chunks) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for c in chunks:
        if c.choices:
            out.setdefault(c.choices[0].index, []).append(c.usage.completion_tokens)
    return out


def test_message_names_reach_the_chat_template(api, tiny_llama):
    """OpenAI's per-message `name` is rendered by the chat template (the built-in one writes it after the
    role), on pd-serve and across P/D alike."""
    from pdserve.engine.tokenizer import apply_chat_template, load_tokenizer

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi", "name": "ann"}]
    tokenizer = load_tokenizer(tiny_llama)
    expected = apply_chat_template(tokenizer, messages)
    unnamed = [{"role": m["role"], "content": m["content"]} for m in messages]
    assert len(expected) > len(apply_chat_template(tokenizer, unnamed))
    out = api.oai.chat.completions.create(model=api.model, messages=messages, max_tokens=2, temperature=0,
                                          extra_body={"return_token_ids": True})
    assert out.usage.prompt_tokens == len(expected)
    assert out.model_extra["prompt_token_ids"] == expected
    status, err = api.post("/v1/chat/completions", {"model": api.model, "messages": [
        {"role": "user", "content": "hi", "name": 7}]})
    assert status == 400 and "messages[0].name must be a string" in err["error"]["message"]


def test_echo_and_prompt_logprobs_match_hf(api, hf_model):
    prompt = PROMPTS[0]
    with torch.inference_mode():
        hf = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0], dim=-1)
    want = [hf[j - 1, prompt[j]].item() for j in range(1, len(prompt))]
    resp = api.oai.completions.create(model=api.model, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                      logprobs=2, extra_body={"prompt_logprobs": 1})
    choice = resp.choices[0]
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:len(prompt)] == pytest.approx(want, abs=1e-4)
    # vLLM's shape: the token itself, then the 2 most likely (texts that decode alike merge)
    assert len(lp.tokens) == len(prompt) + 3 and all(1 <= len(t) <= 3 for t in lp.top_logprobs[1:])
    assert all(next(iter(top)) == token for top, token in zip(lp.top_logprobs[1:], lp.tokens[1:]))
    plain = api.oai.completions.create(model=api.model, prompt=prompt, max_tokens=3, temperature=0)
    assert choice.text.endswith(plain.choices[0].text) and len(choice.text) > len(plain.choices[0].text)
    pl = choice.model_extra["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(prompt)
    assert [pl[j][str(prompt[j])]["logprob"] for j in range(1, len(prompt))] == pytest.approx(want, abs=1e-4)
    text = api.oai.completions.create(model=api.model, prompt="Echo me", max_tokens=2, temperature=0, echo=True)
    assert text.choices[0].text.startswith("Echo me")


PENALTIES = dict(presence=0.6, frequency=1.2, repetition=1.3)
BIAS = {101: 4.0, 40: -100.0}


@pytest.fixture(scope="module")
def penalized_reference(hf_model) -> list[int]:
    """Greedy tokens over HF's logits with logit_bias, then vLLM's penalty formulas (the reference loop)."""
    prompt, output = PROMPTS[1], []
    with torch.inference_mode():
        for _ in range(12):
            logits = hf_model(torch.tensor([prompt + output])).logits[0, -1].clone()
            for token, bias in BIAS.items():
                logits[token] += bias
            output.append(int(reference_penalties(logits, prompt, output, **PENALTIES).argmax()))
    return output


def test_offline_penalties_and_logit_bias_match_the_reference(llm, penalized_reference):
    out = llm.generate([PROMPTS[1]], SamplingParams(
        max_tokens=12, temperature=0, presence_penalty=PENALTIES["presence"], ignore_eos=True,
        frequency_penalty=PENALTIES["frequency"], repetition_penalty=PENALTIES["repetition"], logit_bias=BIAS))
    assert out[0].token_ids == penalized_reference


def test_penalties_and_logit_bias_match_the_reference(api, penalized_reference):
    resp = api.oai.completions.create(
        model=api.model, prompt=PROMPTS[1], max_tokens=12, temperature=0, presence_penalty=PENALTIES["presence"],
        frequency_penalty=PENALTIES["frequency"], logit_bias={str(t): b for t, b in BIAS.items()},
        extra_body={"repetition_penalty": PENALTIES["repetition"], "return_token_ids": True, "ignore_eos": True})
    assert ids_of(resp.choices[0]) == penalized_reference and 40 not in penalized_reference
    chat = api.oai.chat.completions.create(model=api.model, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=5, temperature=0, logit_bias={"66": 100})
    assert chat.choices[0].message.content == "?????"  # token 66 is the byte 63, "?"


def test_structured_outputs_validate(api):
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    for temperature in (0.0, 1.0):
        resp = api.oai.chat.completions.create(model=api.model, messages=[{"role": "user", "content": "a thing"}],
                                               max_tokens=300, temperature=temperature, seed=1, response_format=fmt)
        assert resp.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(resp.choices[0].message.content), SCHEMA)
    obj = api.oai.completions.create(model=api.model, prompt="{", max_tokens=100, temperature=0,
                                     extra_body={"structured_outputs": {"json_object": True,
                                                                        "disable_any_whitespace": True}})
    assert isinstance(json.loads(obj.choices[0].text), dict)
    choice = api.oai.completions.create(model=api.model, prompt="Pick:", max_tokens=10, n=2, temperature=1.0,
                                        extra_body={"guided_choice": ["red", "green", "blue"]})
    assert all(c.text in ("red", "green", "blue") for c in choice.choices)
    regex = api.oai.completions.create(model=api.model, prompt="Code:", max_tokens=10,
                                       extra_body={"guided_regex": r"[A-Z]{2}-\d{3}"})
    assert re.fullmatch(r"[A-Z]{2}-\d{3}", regex.choices[0].text)
    with pytest.raises(openai.BadRequestError) as bad:
        api.oai.chat.completions.create(model=api.model, messages=[{"role": "user", "content": "x"}],
                                        response_format={"type": "json_schema",
                                                         "json_schema": {"name": "x", "schema": {"type": "nope"}}})
    assert bad.value.body["param"] == "response_format" and "invalid JSON schema" in bad.value.body["message"]
    with pytest.raises(openai.BadRequestError) as bad:  # streamed too: refused before the stream starts
        api.oai.completions.create(model=api.model, prompt="x", stream=True, extra_body={"guided_regex": "a(b"})
    assert bad.value.body["param"] == "guided_regex" and "invalid regex" in bad.value.body["message"]
    if api.proxy_pid is not None:  # the nodes compiled every grammar: the proxy never loaded torch
        assert "libtorch" not in open(f"/proc/{api.proxy_pid}/maps").read()


def test_vllm_stop_extras(api):
    base = dict(model=api.model, prompt="The quick brown fox", temperature=0)
    full = api.oai.completions.create(**base, max_tokens=16, extra_body={"ignore_eos": True})
    text = full.choices[0].text
    i = next(i for i in range(2, len(text) - 1) if text.find(text[i:i + 2]) == i and "\ufffd" not in text[i:i + 2])
    cut = api.oai.completions.create(**base, max_tokens=16, stop=[text[i:i + 2]],
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert cut.choices[0].text == text[:i + 2]
    forced = api.oai.completions.create(**base, max_tokens=8, logit_bias={"1": 100},
                                        extra_body={"min_tokens": 3, "return_token_ids": True})
    assert len(ids_of(forced.choices[0])) == 4 and forced.choices[0].finish_reason == "stop"
    special = api.oai.completions.create(**base, max_tokens=8, logit_bias={"1": 100},
                                         extra_body={"min_tokens": 1, "skip_special_tokens": False,
                                                     "include_stop_str_in_output": True})
    assert special.choices[0].text.endswith("</s>")
    by_id = api.oai.completions.create(**base, max_tokens=16, extra_body={
        "ignore_eos": True, "stop_token_ids": [ids_of(api.oai.completions.create(
            **base, max_tokens=16, extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0])[4]]})
    assert by_id.choices[0].finish_reason == "stop" and len(by_id.choices[0].text) < len(full.choices[0].text)


def test_tokenize_detokenize_version(api, pd_serve):
    status, tok = api.post("/tokenize", {"model": api.model, "prompt": "Hello", "return_token_strs": True})
    assert status == 200 and tok["tokens"] == [75, 104, 111, 111, 114] and tok["count"] == 5
    assert tok["token_strs"] == list("Hello") and tok["max_model_len"] == 1024
    status, chat = api.post("/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    resp = api.oai.chat.completions.create(model=api.model, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=1)
    assert status == 200 and chat["count"] == resp.usage.prompt_tokens
    status, de = api.post("/detokenize", {"tokens": tok["tokens"]})
    assert status == 200 and de == {"prompt": "Hello"}
    status, err = api.post("/detokenize", {"tokens": [5, 10**6]})
    assert status == 400 and err["error"]["param"] == "tokens"
    version = httpx.get(api.url + "/version", timeout=10)
    assert version.status_code == 200 and version.json()["version"]


# ------------------------------------------------------------ every openai client parameter

TRANSPORT = {"self", "extra_headers", "extra_query", "extra_body", "timeout"}
BOOL_SCHEMA = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
               "additionalProperties": False}
# A value each honoured parameter is sent with (the request must succeed)...
HONOURED = {
    "best_of": 1, "echo": True, "frequency_penalty": 0.5, "logit_bias": {"70": 2.0}, "logprobs": 2, "max_tokens": 3,
    "n": 2, "presence_penalty": 0.5, "seed": 3, "stop": ["\n"], "stream": False, "stream_options": None,
    "suffix": None, "temperature": 0.7, "top_p": 0.9, "user": "u-1", "max_completion_tokens": 3, "top_logprobs": 2,
    "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": BOOL_SCHEMA}},
    "safety_identifier": "s-1", "store": False, "metadata": {}, "modalities": ["text"], "tools": [],
    "tool_choice": "none", "functions": [], "function_call": "none", "parallel_tool_calls": True,
    "service_tier": "auto",
}
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


def client_parameters(method) -> list[str]:
    return [p for p in inspect.signature(method).parameters if p not in TRANSPORT]


@pytest.mark.parametrize("kind,method", [(COMPLETION, Completions.create), (CHAT, ChatCompletions.create)])
def test_every_client_parameter_is_honoured_or_refused_by_name(api, kind, method):
    """Walks the installed client's create() signature against serving.protocol's tables: a parameter
    a newer client adds fails here until it is placed in one of them."""
    base = {"model": api.model, "prompt": "Hi"} if kind == COMPLETION else \
        {"model": api.model, "messages": [{"role": "user", "content": "Hi"}]}
    create = api.oai.completions.create if kind == COMPLETION else api.oai.chat.completions.create
    for name in client_parameters(method):
        if name in base:
            continue
        supported, neutral = name in SUPPORTED_PARAMETERS[kind], name in NEUTRAL_PARAMETERS
        assert supported or neutral, f"{kind}: the openai client's {name!r} is in neither table"
        if supported or name in HONOURED:
            value = True if (kind, name) == (CHAT, "logprobs") else HONOURED[name]
            extra = {} if name in ("max_tokens", "max_completion_tokens", "response_format") else {"max_tokens": 3}
            create(**base, **extra, **WITH.get(name, {}), **{name: value})  # honoured: no error
        if not supported:
            with pytest.raises(openai.BadRequestError) as refused:
                create(**base, max_tokens=3, **{name: REFUSED[name]})
            assert refused.value.body["param"] == name and name in refused.value.body["message"]


def test_unknown_fields_are_refused_by_name(api):
    with pytest.raises(openai.BadRequestError) as refused:
        api.oai.completions.create(model=api.model, prompt="Hi", max_tokens=2, extra_body={"temprature": 0.5})
    assert refused.value.body["param"] == "temprature" and refused.value.body["code"] == "unsupported_parameter"


# ------------------------------------------------------------ vLLM's request fields and response shapes

def hf_continuation(hf_model, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.inference_mode():
        seq = hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                                attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return seq[0, len(prompt):].tolist()


def test_fields_that_change_the_prompt_tokenize_alike_everywhere(api, tiny_llama, hf_model):
    """continue_final_message, chat_template_kwargs, add_special_tokens and truncation give the prompt the
    tokenizer gives (on P/D: prefill and decode agree, so the output is HF's greedy one on that prompt);
    /tokenize agrees; both template flags true is vLLM's 400."""
    from pdserve.engine.tokenizer import apply_chat_template, load_tokenizer

    tokenizer = load_tokenizer(tiny_llama)
    messages = [{"role": "user", "content": "say abc"}, {"role": "assistant", "content": "ab"}]
    continued = apply_chat_template(tokenizer, messages, False, continue_final_message=True)
    assert continued[-2:] == tokenizer.encode("ab", add_special_tokens=False)  # the assistant turn left open
    extra = {"continue_final_message": True, "add_generation_prompt": False, "return_token_ids": True,
             "chat_template_kwargs": {"enable_thinking": False}, "echo": True}
    resp = api.oai.chat.completions.create(model=api.model, messages=messages, max_tokens=4, temperature=0,
                                           extra_body=extra)
    assert resp.prompt_token_ids == continued
    assert resp.choices[0].token_ids == hf_continuation(hf_model, continued, 4)
    assert resp.choices[0].message.content.startswith("ab")  # vLLM's echo: the continued message first
    status, tok = api.post("/tokenize", {"messages": messages, "continue_final_message": True,
                                         "add_generation_prompt": False})
    assert status == 200 and tok["tokens"] == continued
    status, err = api.post("/v1/chat/completions", {"messages": messages, "continue_final_message": True})
    assert status == 400 and err["error"]["param"] == "continue_final_message"
    prompt = "abcdefghijklmnopqrstuvwxyz" * 3
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    for side, kept in (("left", ids[-20:]), ("right", ids[:20])):
        out = api.oai.completions.create(model=api.model, prompt=prompt, max_tokens=3, temperature=0,
                                         extra_body={"truncate_prompt_tokens": 20, "truncation_side": side,
                                                     "add_special_tokens": False, "return_token_ids": True})
        assert out.choices[0].prompt_token_ids == kept and out.usage.prompt_tokens == 20
        assert out.choices[0].token_ids == hf_continuation(hf_model, kept, 3)
    status, err = api.post("/v1/completions", {"prompt": prompt, "max_tokens": 8,
                                               "truncate_prompt_tokens": MAX_MODEL_LEN})
    assert status == 400 and err["error"]["param"] == "truncate_prompt_tokens"


def test_messages_take_any_role_and_ignore_unknown_keys(api, tiny_llama):
    from pdserve.engine.tokenizer import apply_chat_template, load_tokenizer

    messages = [{"role": "narrator", "content": "once", "id": "m1", "timestamp": 5},
                {"role": "user", "content": "go", "audio": None, "metadata": {"k": 1}}]
    resp = api.oai.chat.completions.create(model=api.model, messages=messages, max_tokens=2,
                                           extra_body={"return_token_ids": True})
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    assert resp.prompt_token_ids == apply_chat_template(load_tokenizer(tiny_llama), plain)
    status, err = api.post("/v1/chat/completions", {"messages": [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "t", "type": "function"}]}]})
    assert status == 400 and "tool_calls" in err["error"]["message"]


def test_return_token_ids_in_vllms_places(api):
    """Completions: prompt_token_ids in each choice (each prompt's own in a batch), streamed on each
    choice's first chunk; chat: beside the choices, streamed on the role chunks (whose logprobs are
    null). Without return_token_ids the fields are there as null, as vLLM sends them."""
    batch = api.oai.completions.create(model=api.model, prompt=[[5, 6, 7], [8, 9]], n=2, max_tokens=2,
                                       extra_body={"return_token_ids": True})
    assert [c.prompt_token_ids for c in batch.choices] == [[5, 6, 7], [5, 6, 7], [8, 9], [8, 9]]
    assert "prompt_token_ids" not in batch.model_extra
    plain = api.oai.completions.create(model=api.model, prompt="Hi", max_tokens=2).choices[0].model_dump()
    assert {k: plain[k] for k in ("token_ids", "prompt_token_ids", "prompt_logprobs")} == \
        dict.fromkeys(("token_ids", "prompt_token_ids", "prompt_logprobs"))
    chunks = list(api.oai.completions.create(model=api.model, prompt=[[5, 6, 7], [8, 9]], n=2, max_tokens=3,
                                             stream=True, extra_body={"return_token_ids": True,
                                                                      "ignore_eos": True}))
    firsts: dict[int, Any] = {}
    for c in chunks:
        firsts.setdefault(c.choices[0].index, c.choices[0])
        if firsts[c.choices[0].index] is not c.choices[0]:
            assert "prompt_token_ids" not in c.choices[0].model_extra
    assert {i: c.prompt_token_ids for i, c in firsts.items()} == {0: [5, 6, 7], 1: [5, 6, 7], 2: [8, 9], 3: [8, 9]}
    chat = dict(model=api.model, messages=[{"role": "user", "content": "ids"}], max_tokens=3, temperature=0,
                logprobs=True)
    whole = api.oai.chat.completions.create(**chat, extra_body={"return_token_ids": True})
    stream = list(api.oai.chat.completions.create(**chat, n=2, stream=True, extra_body={"return_token_ids": True}))
    roles = [c for c in stream if c.choices[0].delta.role]
    assert [c.prompt_token_ids for c in roles] == [whole.prompt_token_ids] * 2
    assert all(c.choices[0].logprobs is None for c in roles)
    assert all("prompt_token_ids" not in c.model_extra for c in stream if not c.choices[0].delta.role)
    assert [t for c in stream if c.choices[0].index == 0 for t in c.choices[0].model_extra.get("token_ids", [])] == \
        whole.choices[0].token_ids
    unasked = api.oai.chat.completions.create(**chat).model_dump()
    assert unasked["prompt_token_ids"] is None and unasked["prompt_logprobs"] is None
    assert unasked["choices"][0]["token_ids"] is None


def test_completion_logprobs_zero_and_tokens_as_token_ids(api):
    """logprobs=0: one top_logprobs entry per position (the token itself), echoed prompt too (its first
    token none); return_tokens_as_token_ids names every token 'token_id:N' (chat as well)."""
    prompt = PROMPTS[0][:6]
    body = dict(model=api.model, prompt=prompt, max_tokens=3, temperature=0, logprobs=0, echo=True)
    lp = api.oai.completions.create(**body).choices[0].logprobs
    assert lp.top_logprobs[0] is None and len(lp.top_logprobs) == len(prompt) + 3
    assert [list(t.items()) for t in lp.top_logprobs[1:]] == [[p] for p in zip(lp.tokens[1:], lp.token_logprobs[1:])]
    named = api.oai.completions.create(**body, extra_body={"return_tokens_as_token_ids": True,
                                                           "return_token_ids": True}).choices[0]
    assert named.logprobs.tokens == [f"token_id:{t}" for t in prompt + named.token_ids]
    assert named.logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    chat = api.oai.chat.completions.create(model=api.model, messages=[{"role": "user", "content": "n"}],
                                           max_tokens=2, temperature=0, logprobs=True, top_logprobs=2,
                                           extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True})
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == [f"token_id:{t}" for t in chat.choices[0].token_ids]
    assert all(t.token.startswith("token_id:") for c in content for t in c.top_logprobs)


def test_request_id_priority_bad_words_allowed_token_ids(api):
    rid = f"body-id-{KINDS.index(api.kind)}"
    resp = api.oai.completions.create(model=api.model, prompt="Hi", max_tokens=2,
                                      extra_body={"request_id": rid, "priority": 5})
    assert resp.id == f"cmpl-{rid}"
    headed = api.oai.completions.create(model=api.model, prompt="Hi", max_tokens=2, extra_body={"request_id": rid},
                                        extra_headers={"X-Request-Id": f"{rid}-h"})
    assert headed.id == f"cmpl-{rid}-h"  # the header wins, as in vLLM
    raw = api.oai.completions.with_raw_response.create(model=api.model, prompt="Hi", max_tokens=2,
                                                       extra_body={"request_id": f"{rid}-raw"})
    assert raw.headers["x-request-id"] == f"{rid}-raw"  # the id the logs carry, middleware's line included
    base = dict(model=api.model, prompt=PROMPTS[1], max_tokens=16, temperature=0)
    free = api.oai.completions.create(**base, extra_body={"return_token_ids": True, "ignore_eos": True})
    ids = free.choices[0].token_ids
    i = adjacent_letters(ids)
    word = "".join(chr(t - 3) for t in ids[i:i + 2])  # byte tokens
    banned = api.oai.completions.create(**base, extra_body={"bad_words": [word], "ignore_eos": True,
                                                            "return_token_ids": True})
    assert banned.choices[0].token_ids[:i + 1] == ids[:i + 1] and banned.choices[0].token_ids[i + 1] != ids[i + 1]
    allowed = api.oai.completions.create(**base, extra_body={"allowed_token_ids": [70, 71], "return_token_ids": True})
    assert set(allowed.choices[0].token_ids) <= {70, 71}
    for field_, value in (("allowed_token_ids", [10**6]), ("logprob_token_ids", [5]), ("request_id", "a b"),
                          ("truncation_side", "middle"), ("chat_template_kwargs", {"tokenize": True})):
        status, err = api.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                        field_: value})
        assert status == 400 and err["error"]["param"] == field_, (field_, err)


def test_return_tokens_as_token_ids_flag(cluster):
    """vLLM's --return-tokens-as-token-ids on the proxy (it formats the P/D answers): the field's default."""
    child, url = extra_proxy(cluster, "proxy-token-ids", "--return-tokens-as-token-ids")
    try:
        oai = client(url)
        body = dict(model=oai.models.list().data[0].id, prompt="Hi", max_tokens=2, logprobs=1)
        assert all(t.startswith("token_id:") for t in oai.completions.create(**body).choices[0].logprobs.tokens)
        off = oai.completions.create(**body, extra_body={"return_tokens_as_token_ids": False})
        assert not any(t.startswith("token_id:") for t in off.choices[0].logprobs.tokens)
    finally:
        child.stop()


def test_beam_search_equals_hf(api, hf_model):
    """use_beam_search with n as the width and length_penalty, completions and chat: the n choices are HF's
    num_beams=n sequences, best first (on P/D decode runs the search on the prompt loaded from the store)."""
    from tests.helpers.oracles import hf_beams

    prompt = PROMPTS[1]
    extra = {"use_beam_search": True, "length_penalty": 0.7, "return_token_ids": True}
    resp = api.oai.completions.create(model=api.model, prompt=prompt, n=3, max_tokens=8, echo=True, extra_body=extra)
    assert [c.token_ids for c in resp.choices] == hf_beams(hf_model, prompt, 3, 0.7, 8)
    assert resp.usage.completion_tokens == sum(len(c.token_ids) for c in resp.choices)
    chat = api.oai.chat.completions.create(model=api.model, messages=[{"role": "user", "content": "beams"}], n=2,
                                           max_tokens=6, extra_body=extra)
    assert [c.token_ids for c in chat.choices] == hf_beams(hf_model, chat.prompt_token_ids, 2, 0.7, 6)
    for body, param in (({"stream": True}, "use_beam_search"), ({"logprobs": 1}, "logprobs"),
                        ({"stop": ["x"]}, "stop")):
        status, err = api.post("/v1/completions", {"prompt": "x", "n": 2, "use_beam_search": True, **body})
        assert status == 400 and err["error"]["param"] == param, err


def test_logprob_token_ids_match_hf(api, hf_model):
    """vLLM's logprob_token_ids: at every position the sampled token, then the asked-for tokens' logprobs
    (in place of the most likely ones), equal to HF's log-softmax; it needs logprobs."""
    prompt, asked = PROMPTS[0], [70, 71, 300]
    extra = {"logprob_token_ids": asked, "return_token_ids": True, "return_tokens_as_token_ids": True}
    choice = api.oai.completions.create(model=api.model, prompt=prompt, max_tokens=3, temperature=0, logprobs=0,
                                        extra_body=extra).choices[0]
    with torch.inference_mode():
        hf = torch.log_softmax(hf_model(torch.tensor([prompt + choice.token_ids[:-1]])).logits[0, len(prompt) - 1:], -1)
    for top, token, row in zip(choice.logprobs.top_logprobs, choice.token_ids, hf):
        assert list(top) == [f"token_id:{t}" for t in [token, *asked]]
        assert list(top.values()) == pytest.approx([row[t].item() for t in [token, *asked]], abs=1e-4)
    chat = api.oai.chat.completions.create(model=api.model, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                           temperature=0, logprobs=True, extra_body=extra)
    for entry, token in zip(chat.choices[0].logprobs.content, chat.choices[0].token_ids):
        assert [t.token for t in entry.top_logprobs] == [f"token_id:{t}" for t in [token, *asked]]
    status, err = api.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                    "logprob_token_ids": asked})
    assert status == 400 and err["error"]["param"] == "logprob_token_ids"
