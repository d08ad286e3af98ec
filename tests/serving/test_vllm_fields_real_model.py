"""vLLM's prompt-shaping chat fields and beam search on SmolLM2-135M-Instruct, through pd-serve and P/D (proxy ->
prefill node -> file store -> decode node): continue_final_message continues an assistant prefill,
chat_template_kwargs reach the template, truncation keeps the tokens it says; every answer is HF's
greedy continuation of the prompt the tokenizer gives (fp32), and P/D answers what pd-serve answers.

The checkpoint is SmolLM2's own files (weights linked, not copied) with one line added in front of its
chat template: the `enable_thinking` switch Qwen3-style templates read, so that a template variable
visibly changes the prompt."""
from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from pdserve.deploy.processes import CHUNK_SIZE
from pdserve.deploy.server_process import ServerProcess
from pdserve.engine.tokenizer import apply_chat_template, load_tokenizer
from tests.helpers.cluster import client, start_cluster
from tests.helpers.real_model import near_ties

NODE_ARGS = ["--dtype", "float32", "--kv-cache-memory", "96MiB", "--max-model-len", "1024",
             "--chunk-size", str(CHUNK_SIZE), "--shutdown-timeout", "1"]
NO_THINK = ("{% if enable_thinking is defined and not enable_thinking %}<|im_start|>system\n/no_think<|im_end|>\n"
            "{% endif %}")
PREFILL = [{"role": "user", "content": "What is the capital of France?"},
           {"role": "assistant", "content": "The capital of France is"}]


@pytest.fixture(scope="module")
def model_dir(smollm2, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("smollm2-no-think") / "SmolLM2-no-think"
    path.mkdir()
    for f in smollm2.iterdir():
        if f.name != "chat_template.jinja":
            (path / f.name).symlink_to(f)
    (path / "chat_template.jinja").write_text(NO_THINK + (smollm2 / "chat_template.jinja").read_text())
    return path


@pytest.fixture(scope="module")
def urls(model_dir, tmp_path_factory):
    """{"pd-serve": url, "proxy": url}"""
    cluster = start_cluster(model_dir, tmp_path_factory.mktemp("vllm-fields-real"), store="file",
                            node_args=NODE_ARGS)
    try:
        with ServerProcess("--model", str(model_dir), *NODE_ARGS[:NODE_ARGS.index("--chunk-size")]) as serve:
            yield {"pd-serve": serve.url, "proxy": cluster.url}
    finally:
        cluster.stop()


def chat(url: str, model_dir: Path, messages, **extra):
    return client(url).chat.completions.create(model=model_dir.name, messages=messages, temperature=0,
                                               max_tokens=8, extra_body={"return_token_ids": True, **extra})


@pytest.mark.slow  # seconds: outside make test-quick
def test_continue_final_message_continues_the_assistant_prefill(urls, model_dir):
    tokenizer = load_tokenizer(model_dir)
    expected = apply_chat_template(tokenizer, PREFILL, False, continue_final_message=True)
    assert tokenizer.decode(expected).endswith("<|im_start|>assistant\nThe capital of France is")
    answers = {}
    for kind, url in urls.items():
        resp = chat(url, model_dir, PREFILL, continue_final_message=True, add_generation_prompt=False, echo=True)
        assert resp.prompt_token_ids == expected, kind
        assert resp.choices[0].message.content.startswith("The capital of France is Paris"), kind
        answers[kind] = resp.choices[0].token_ids
        streamed = client(url).chat.completions.create(
            model=model_dir.name, messages=PREFILL, temperature=0, max_tokens=8, stream=True,
            extra_body={"continue_final_message": True, "add_generation_prompt": False})
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == \
            resp.choices[0].message.content.removeprefix("The capital of France is"), kind
    assert answers["proxy"] == answers["pd-serve"]
    assert not near_ties(model_dir, [expected], [answers["pd-serve"]])
    closed = chat(urls["pd-serve"], model_dir, PREFILL, add_generation_prompt=False)  # the turn is closed
    assert closed.prompt_token_ids == apply_chat_template(tokenizer, PREFILL, False) != expected


@pytest.mark.slow  # seconds: outside make test-quick
def test_chat_template_kwargs_and_truncation_shape_the_prompt_alike(urls, model_dir):
    tokenizer = load_tokenizer(model_dir)
    question = [PREFILL[0]]
    plain = apply_chat_template(tokenizer, question)
    no_think = apply_chat_template(tokenizer, question, chat_template_kwargs={"enable_thinking": False})
    assert len(no_think) > len(plain) and "/no_think" in tokenizer.decode(no_think)
    for kind, url in urls.items():
        resp = chat(url, model_dir, question, chat_template_kwargs={"enable_thinking": False})
        assert resp.prompt_token_ids == no_think, kind
        assert not near_ties(model_dir, [no_think], [resp.choices[0].token_ids]), kind
        cut = chat(url, model_dir, question, truncate_prompt_tokens=12)
        assert cut.prompt_token_ids == plain[-12:] and cut.usage.prompt_tokens == 12, kind
        assert not near_ties(model_dir, [plain[-12:]], [cut.choices[0].token_ids]), kind
        tok = httpx.post(url + "/tokenize", json={"messages": question,
                                                  "chat_template_kwargs": {"enable_thinking": False}}, timeout=60)
        assert tok.json()["tokens"] == no_think, kind


@pytest.mark.slow  # seconds: outside make test-quick
def test_beam_search_equals_hf_with_beams_ending_at_eos(urls, model_dir):
    """Beams that end at <|im_end|> are finished hypotheses ranked by HF's length-normalised score."""
    from tests.helpers.real_model import _hf_model
    from tests.helpers.oracles import hf_beams

    tokenizer = load_tokenizer(model_dir)
    prompt = apply_chat_template(tokenizer, [PREFILL[0]])
    want = hf_beams(_hf_model(model_dir), prompt, 3, 1.0, 24, tokenizer.eos_token_id)
    assert all(beam[-1] == tokenizer.eos_token_id for beam in want)  # the search ended on finished beams
    for kind, url in urls.items():
        resp = client(url).chat.completions.create(model=model_dir.name, messages=[PREFILL[0]], n=3, max_tokens=24,
                                                   extra_body={"use_beam_search": True, "return_token_ids": True})
        assert [c.token_ids for c in resp.choices] == want, kind
        assert [c.finish_reason for c in resp.choices] == ["stop"] * 3, kind
        assert resp.choices[0].message.content == "The capital of France is Paris.", kind
