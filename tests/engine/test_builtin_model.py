"""pd-make-model checkpoints, the tokenizer helpers and default_model_path()."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pdserve.engine.builtin_model import default_model_path, main, make_model
from pdserve.engine.tokenizer import IncrementalDetokenizer, apply_chat_template, encode_prompt, load_tokenizer

PD_MAKE_MODEL = str(Path(sys.executable).with_name("pd-make-model"))


def test_cli_writes_a_checkpoint_transformers_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "m"
    assert main([str(out), "--preset", "tiny", "--arch", "qwen2", "--num-kv-heads", "1"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["num_key_value_heads"] == 1
    assert config["eos_token_id"] == 1 and config["vocab_size"] >= 384
    assert "random weights" in config["pdserve_note"] and "not a real model" in (out / "README.md").read_text()
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.tie_word_embeddings
    tokenizer = load_tokenizer(out)
    assert tokenizer.eos_token_id == 1 and tokenizer.pad_token_id == 0
    assert "chat_template" in json.loads((out / "tokenizer_config.json").read_text())


def test_cli_console_script_rejects_bad_preset(tmp_path):
    done = subprocess.run([PD_MAKE_MODEL, str(tmp_path / "m"), "--preset", "huge"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "invalid choice: 'huge'" in done.stderr and "Traceback" not in done.stderr


def test_same_seed_same_weights(tmp_path):
    a = load_file(make_model(tmp_path / "a", seed=7) / "model.safetensors")
    b = load_file(make_model(tmp_path / "b", seed=7) / "model.safetensors")
    c = load_file(make_model(tmp_path / "c", seed=8) / "model.safetensors")
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_default_model_path_is_made_once(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    with ThreadPoolExecutor(2) as pool:  # two racing callers both get the complete model
        paths = set(pool.map(lambda _: default_model_path(), range(2)))
    models = tmp_path / "models"
    assert paths == {models / "tiny-random-llama"}
    assert sorted(p.name for p in models.iterdir()) == ["tiny-random-llama"]  # no temp dirs left behind
    assert (models / "tiny-random-llama" / "model.safetensors").exists()


def test_tokenizer_prompt_chat_and_incremental_text(tiny_llama, tmp_path):
    tokenizer = load_tokenizer(tiny_llama)
    ids = encode_prompt(tokenizer, "héllo 😀")
    assert ids[-1] != tokenizer.eos_token_id and tokenizer.decode(ids) == "héllo 😀"
    chat = apply_chat_template(tokenizer, [{"role": "user", "content": "hi"}])
    assert tokenizer.decode(chat) == "<|user|>\nhi\n<|assistant|>\n"

    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=ids)
    deltas = [detok.add_tokens([t]) for t in encode_prompt(tokenizer, "é😀!")]
    assert deltas == ["", "é", "", "", "", "😀", "!"]  # a character appears only once all its bytes are in
    assert detok.text == "é😀!"
    assert detok.add_tokens([0xF0 + 3]) == "" and detok.flush() == ""  # a dangling lead byte never shows up

    # Special ids (pad 0, eos 1) are skipped exactly as the tokenizer's own skip_special_tokens does.
    mixed = encode_prompt(tokenizer, "ab") + [tokenizer.eos_token_id, tokenizer.pad_token_id] + encode_prompt(tokenizer, "c")
    skipping = IncrementalDetokenizer(tokenizer)
    assert "".join(skipping.add_tokens([t]) for t in mixed) + skipping.flush() == \
        tokenizer.decode(mixed, skip_special_tokens=True) == "abc"
    keeping = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert "".join(keeping.add_tokens([t]) for t in mixed) + keeping.flush() == tokenizer.decode(mixed)

    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(tokenizer, [{"role": "user", "content": "hi"}])


def test_gpu_preset_is_a_1b_bf16_llama():
    """`pd-make-model --preset gpu`: big enough to keep a GPU busy (shapes only: no weights are drawn)."""
    from pdserve.engine.builtin_model import _param_shapes, build_config

    cfg = build_config("gpu")
    params = sum(math.prod(shape) for shape in _param_shapes(cfg).values())
    assert 0.9e9 < params < 1.1e9 and str(cfg.dtype).endswith("bfloat16")
    assert cfg.num_attention_heads // cfg.num_key_value_heads == 4 and cfg.head_dim == 64
