"""The OpenAI API that vLLM users send, with the `openai` client, through pd-serve and through pd-proxy
over P/D with a file store (decode samples everything): batched prompts, n, echo, prompt_logprobs,
penalties and logit_bias, structured outputs, vLLM's stop/min_tokens extras, /tokenize /detokenize
/version. Greedy outputs stay token-identical to HF where nothing reshapes the logits."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import torch

from serving import LLM, SamplingParams
from tests.cluster_helpers import NODE_ARGS, client, log_lines, start_cluster
from tests.serve_helpers import ServerProcess
from tests.test_generate import hf_greedy, random_prompt

PROMPTS = [random_prompt(n, seed=900 + n) for n in (20, 37)]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4},
                                           "size": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["name", "size"], "additionalProperties": False}


@dataclass
class API:
    kind: str  # pd-serve | proxy
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


@pytest.fixture(scope="module", params=["pd-serve", "proxy"])
def api(request, pd_serve, cluster) -> API:
    if request.param == "pd-serve":
        url, stats_url, log = pd_serve.url, pd_serve.url, None
    else:
        decode = cluster.decode[0]
        url, stats_url, log = cluster.url, f"http://127.0.0.1:{decode.http_port}", decode.log_file
    oai = client(url)
    return API(request.param, url, oai, oai.models.list().data[0].id, stats_url, log,
               cluster.proxy.proc.pid if request.param == "proxy" else None)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32", kv_cache_memory="16MiB")


@pytest.fixture(scope="module")
def hf_refs(tiny_llama):
    return hf_greedy(tiny_llama, PROMPTS, 8)


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
    prompt = random_prompt(45, seed=77)
    before = api.stats()
    resp = api.oai.completions.create(model=api.model, prompt=prompt, n=3, max_tokens=6, temperature=1.0, seed=5,
                                      extra_body={"return_token_ids": True, "ignore_eos": True},
                                      extra_headers={"X-Request-Id": f"{api.kind}-n3"})
    after = api.stats()
    # The prompt is computed once: all of it on pd-serve; on P/D decode computes only its last token.
    computed = after["num_prompt_tokens_computed"] - before["num_prompt_tokens_computed"]
    assert computed == (len(prompt) if api.kind == "pd-serve" else 1)
    if api.decode_log is not None:  # ... and loads it from the store once
        assert len([x for x in log_lines(api.decode_log, f"{api.kind}-n3") if "Retrieved" in x]) == 1
    offline = llm.generate([prompt], SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=5, ignore_eos=True))
    assert [ids_of(c) for c in resp.choices] == [o.token_ids for o in offline]
    chunks = list(api.oai.completions.create(model=api.model, prompt=prompt, n=3, max_tokens=6, temperature=1.0,
                                             seed=5, stream=True, extra_body={"ignore_eos": True}))
    order = [c.choices[0].index for c in chunks if c.choices]
    assert set(order) == {0, 1, 2} and order != sorted(order)  # interleaved, as OpenAI streams them
    for i in range(3):
        assert "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) == \
            resp.choices[i].text


def test_echo_and_prompt_logprobs_match_hf(api, tiny_llama):
    from transformers import AutoModelForCausalLM

    prompt = PROMPTS[0]
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    with torch.inference_mode():
        hf = torch.log_softmax(model(torch.tensor([prompt])).logits[0], dim=-1)
    want = [hf[j - 1, prompt[j]].item() for j in range(1, len(prompt))]
    resp = api.oai.completions.create(model=api.model, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                      logprobs=2, extra_body={"prompt_logprobs": 1})
    choice = resp.choices[0]
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:len(prompt)] == pytest.approx(want, abs=1e-4)
    assert len(lp.tokens) == len(prompt) + 3 and all(len(t) <= 2 for t in lp.top_logprobs[1:])
    plain = api.oai.completions.create(model=api.model, prompt=prompt, max_tokens=3, temperature=0)
    assert choice.text.endswith(plain.choices[0].text) and len(choice.text) > len(plain.choices[0].text)
    pl = choice.model_extra["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(prompt)
    assert [pl[j][str(prompt[j])]["logprob"] for j in range(1, len(prompt))] == pytest.approx(want, abs=1e-4)
    text = api.oai.completions.create(model=api.model, prompt="Echo me", max_tokens=2, temperature=0, echo=True)
    assert text.choices[0].text.startswith("Echo me")


def test_penalties_and_logit_bias_match_the_engine(api, llm):
    prompt = PROMPTS[1]
    kw = dict(frequency_penalty=1.2, presence_penalty=0.6, logit_bias={"101": 4.0, "40": -100})
    extra = {"repetition_penalty": 1.3, "return_token_ids": True, "ignore_eos": True}
    resp = api.oai.completions.create(model=api.model, prompt=prompt, max_tokens=12, temperature=0, **kw,
                                      extra_body=extra)
    want = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, frequency_penalty=1.2,
                                                 presence_penalty=0.6, repetition_penalty=1.3, ignore_eos=True,
                                                 logit_bias={101: 4.0, 40: -100}))[0].token_ids
    assert ids_of(resp.choices[0]) == want and 40 not in want
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
