"""The offline API's vLLM conveniences: LLM.chat, stop-token text rules, min_tokens, and log lines by default."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pdserve.engine.tokenizer import apply_chat_template
from pdserve.serving import LLM, SamplingParams
from tests.helpers.prompts import adjacent_letters

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32", kv_cache_memory="16MiB")


def test_chat_is_generate_over_the_chat_template(llm):
    params = SamplingParams(max_tokens=8, temperature=0.0)
    ids = apply_chat_template(llm.engine.tokenizer, MESSAGES)
    chat = llm.chat(MESSAGES, params)
    assert len(chat) == 1 and chat[0].prompt_token_ids == ids
    assert chat[0].token_ids == llm.generate([ids], params)[0].token_ids
    two = llm.chat([MESSAGES, MESSAGES[1:]], params)
    assert [o.token_ids for o in two][0] == chat[0].token_ids and len(two) == 2


def test_results_have_vllms_shape(llm):
    """What a vLLM script reads: one RequestOutput per prompt, its choices in `outputs`, per-token
    logprobs as {token id: Logprob} only when asked, and the prompt text for string prompts."""
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=2)  # vLLM's int: top 2
    assert (params.logprobs, params.top_logprobs) == (True, 2)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=-1)
    text, ids = llm.generate(["Hello", [5, 6, 7]], params)
    assert (text.prompt, ids.prompt, ids.prompt_token_ids) == ("Hello", None, [5, 6, 7]) and text.finished
    first = text.outputs[0]
    assert first.index == 0 and len(first.token_ids) == 5 and first.finished() and first.finish_reason == "length"
    assert first.text == llm.engine.tokenizer.decode(first.token_ids, skip_special_tokens=True)
    assert len(first.logprobs) == 5
    for token, position in zip(first.token_ids, first.logprobs):
        sampled = position[token]  # greedy: the sampled token is the most likely one
        assert sampled.rank == 1 and sampled.decoded_token == llm.engine.tokenizer.decode([token])
        assert len(position) == 2 and all(lp.logprob <= sampled.logprob for lp in position.values())
    assert first.cumulative_logprob == pytest.approx(sum(p[t].logprob for t, p in zip(first.token_ids,
                                                                                      first.logprobs)))
    plain = llm.generate("Hello", SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0].outputs[0]
    assert plain.token_ids == first.token_ids and plain.logprobs is None and plain.cumulative_logprob is None
    chat = llm.chat(MESSAGES, SamplingParams(max_tokens=2, temperature=0.0))[0]
    assert chat.prompt == llm.engine.tokenizer.decode(chat.prompt_token_ids)


def test_min_tokens_then_eos_and_its_text(llm):
    """A +100 bias on EOS would end at once; min_tokens holds it off. The EOS text is not output
    unless include_stop_str_in_output (and then only with skip_special_tokens=False)."""
    eos = llm.engine.eos_token_id
    base = dict(max_tokens=10, temperature=0.0, logit_bias={eos: 100.0}, min_tokens=3)
    out = llm.generate("abc", SamplingParams(**base))[0]
    assert len(out.token_ids) == 4 and out.token_ids[-1] == eos and out.finish_reason == "stop"
    shown = llm.generate("abc", SamplingParams(**base, skip_special_tokens=False, include_stop_str_in_output=True))[0]
    hidden = llm.generate("abc", SamplingParams(**base, skip_special_tokens=False))[0]
    assert shown.text == hidden.text + "</s>" and "</s>" not in hidden.text
    assert out.text in hidden.text and len(out.text) <= len(hidden.text)  # special tokens shown, not skipped


def test_stop_strings_include_stop_str_in_output(llm):
    full = llm.generate("The quick brown fox", SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    i = next(i for i, c in enumerate(full.text) if i > 2 and c.isprintable() and c != "\ufffd")
    stop = full.text[i]
    cut = llm.generate("The quick brown fox", SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                             stop=[stop], include_stop_str_in_output=True))[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.index(stop) + 1]
    late = llm.generate("The quick brown fox", SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                              stop=[stop], min_tokens=24))[0]
    assert late.finish_reason == "length"  # stop strings are not checked before min_tokens


def run_offline(script: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.getcwd(), **env})


@pytest.mark.slow
def test_offline_api_prints_its_log_lines_kv_transfer_included(tiny_llama, tmp_path):
    store = (tmp_path / "store").as_uri()
    script = f"""
from pdserve.serving import LLM, SamplingParams
p = SamplingParams(max_tokens=2, temperature=0.0)
prompt = list(range(3, 43))
LLM({str(tiny_llama)!r}, kv_store={store!r}, kv_role="producer", chunk_size=16).generate([prompt], p)
LLM({str(tiny_llama)!r}, kv_store={store!r}, kv_role="consumer", chunk_size=16).generate([prompt], p)
"""
    shown = run_offline(script, {})
    assert shown.returncode == 0, shown.stderr
    for line in ("engine ready", "Reqid: gen-0, Stored 40 tokens", "KV hit tokens: 40, need to load: 39",
                 "Reqid: gen-0, Retrieved 40 tokens", "Reqid: gen-0, finished (length)"):
        assert line in shown.stdout, (line, shown.stdout)
    quiet = run_offline(script.split("LLM(")[0] + f"LLM({str(tiny_llama)!r}).generate([prompt], p)",
                        {"PDSERVE_CONFIGURE_LOGGING": "0"})
    assert quiet.returncode == 0 and "Reqid" not in quiet.stdout + quiet.stderr


def test_bad_words_and_allowed_token_ids(llm):
    """vLLM's rules: a bad word's last token is banned where the output ends with its other tokens (the word
    as written and with a leading space); allowed_token_ids bans every other token."""
    from pdserve.engine.token_masks import bad_words_token_ids, banned_tokens

    tokenizer = llm.engine.tokenizer
    words = bad_words_token_ids(tokenizer, ["ab"], llm.engine.vocab_size)
    # byte tokens: " ab" is one token longer, so not a second spelling of the same word (vLLM's rule)
    assert words == [tokenizer.encode("ab", add_special_tokens=False)]
    assert banned_tokens(words, tokenizer.encode("xa", add_special_tokens=False)) == {words[0][-1]}
    assert banned_tokens(words, []) == set()
    params = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
    free = llm.generate(["Tell me"], SamplingParams(**params))[0]
    i = adjacent_letters(free.token_ids)
    banned = llm.generate(["Tell me"], SamplingParams(bad_words=[tokenizer.decode(free.token_ids[i:i + 2])],
                                                      **params))[0]
    assert banned.token_ids[:i + 1] == free.token_ids[:i + 1] and banned.token_ids[i + 1] != free.token_ids[i + 1]
    allowed = llm.generate(["Tell me"], SamplingParams(allowed_token_ids=[70, 71], **params))[0]
    assert set(allowed.token_ids) <= {70, 71}
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate(["x"], SamplingParams(allowed_token_ids=[10**6]))
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=[""])
