"""The built wheel, installed into a fresh venv outside the checkout, serves with its compiled kernels.

The wheel is built from a copy of what pyproject.toml packages (`pip wheel --no-build-isolation`, this
venv's setuptools) and installed with `pip --python <new venv> install --no-deps --no-index`. The new
venv gets its dependencies without a download: a .pth line names this venv's site-packages as a plain
path, which Python appends to sys.path without running the .pth files there (the editable pdserve's
finder among them); LMCache, found there too, is kept unimportable, as in an install without the `lmcache`
extra (the wheel's metadata makes it an extra, and an lm:// store then stops a node with what to install). Every command runs from a temporary directory with PYTHONPATH unset and its own
PDSERVE_CACHE_DIR, so `import pdserve` can only find the installed copy, and the C kernels are built
from the installed sources. What is checked: site-packages gained `pdserve` alone (and its
dist-info); `pd-serve` answers a completion; `pd-prefill` + `pd-decode` + `pd-proxy` over a file store
answer the same text with the prompt's KV loaded from the store; the offline `LLM` gives the same
tokens as Hugging Face, also with no compiler and only the libraries `--prebuild` left in the venv (the
container image's way); and every one of them ran the compiled paths (the attention backend, the block
ops, the store's native reader) with no fallback warning.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
import tomllib
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from pdserve.common.native_build import runnable_targets
from pdserve.deploy.processes import REPO, SHARED_CORES_ENV, free_port
from tests.helpers.connector import hf_greedy

pytestmark = pytest.mark.slow  # builds a wheel and a venv, then starts servers from it

PROMPT = "The wheel under test, installed outside the checkout, " * 6  # 330 byte tokens: two KV chunks
MAX_TOKENS = 8
STARTUP_S = 180.0  # a first start builds the kernels
_DROPPED_ENV = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PDSERVE_KERNELS", "PDSERVE_CACHE_DIR")


@dataclass
class Install:
    root: Path  # the temporary working directory of every command
    venv: Path
    site: Path
    gained: set[str]  # what `pip install` of the wheel added to site-packages
    env: dict[str, str]
    model: Path = Path()
    procs: list[subprocess.Popen] = field(default_factory=list)

    def bin(self, name: str) -> str:
        return str(self.venv / "bin" / name)

    def run(self, argv: list[str], timeout_s: float = 300.0, env: dict[str, str] | None = None) -> str:
        proc = subprocess.run(argv, cwd=self.root, env={**self.env, **(env or {})}, capture_output=True, text=True,
                              timeout=timeout_s)
        assert proc.returncode == 0, \
            f"{argv[0]} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        return proc.stdout

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Path:
        log = self.root / f"{name}.log"
        with open(log, "wb") as out:
            self.procs.append(subprocess.Popen(argv, cwd=self.root, env={**self.env, **(env or {})}, stdout=out,
                                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        return log

    def stop_all(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()


def _run(argv: list[str], cwd: Path, timeout_s: float = 300.0) -> None:
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, f"{' '.join(argv[:5])} ... exited {proc.returncode}:\n{proc.stderr[-3000:]}"


def _build_wheel(work: Path) -> Path:
    """The wheel of a copy of what pyproject.toml packages (a build in the checkout would leave build/ and
    an egg-info there)."""
    with open(REPO / "pyproject.toml", "rb") as f:
        meta = tomllib.load(f)
    src = work / "src"
    src.mkdir()
    for name in ("pyproject.toml", meta["project"]["readme"]):
        shutil.copy2(REPO / name, src / name)
    for folder in set(meta["tool"]["setuptools"]["package-dir"].values()):
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-w",
          str(work / "dist"), str(src)], work)
    (wheel,) = (work / "dist").glob("pdserve-*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return _build_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="module")
def installed(wheel):
    work = wheel.parent.parent
    venv = work / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], work)
    python = str(venv / "bin" / "python")
    site = Path(subprocess.run([python, "-I", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True, timeout=60).stdout.strip())
    before = set(os.listdir(site))
    _run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", str(wheel)],
         work)
    gained = set(os.listdir(site)) - before
    deps = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (Path(site) / "_test_dependencies.pth").write_text("".join(f"{path}\n" for path in deps))
    # The wheel without its `lmcache` extra: LMCache (in this venv's site-packages) cannot be imported there.
    (Path(site) / "_without_lmcache.pth").write_text("import sys; sys.modules['lmcache'] = None\n")
    root = work / "run"
    root.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV}
    env.update(PDSERVE_CACHE_DIR=str(work / "cache"), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1", PATH=f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    install = Install(root, venv, Path(site), gained, env)
    # The built-in model, made once by the installed package (the servers below find it in the cache).
    install.model = Path(install.run([python, "-c", "from pdserve.engine.builtin_model import default_model_path; "
                                               "print(default_model_path())"]).strip())
    yield install
    install.stop_all()


def _wait_for(url: str, procs: list[subprocess.Popen], logs: list[Path], ready) -> None:
    deadline = time.monotonic() + STARTUP_S
    while True:
        try:
            r = httpx.get(url, timeout=2)
            if r.status_code == 200 and ready(r):
                return
        except httpx.HTTPError:
            pass
        dead = [p for p in procs if p.poll() is not None]
        assert not dead and time.monotonic() < deadline, \
            "not ready:\n" + "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs)
        time.sleep(0.5)


def _complete(url: str) -> str:
    r = httpx.post(f"{url}/v1/completions", timeout=120,
                   json={"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == MAX_TOKENS, r.text
    return r.json()["choices"][0]["text"]


def _compiled_and_no_fallback(log: str, *libraries: str) -> None:
    """Each library loaded from the run's own cache (built there from the installed sources, or the build an
    earlier command of this run left), and no compiled path fell back."""
    for name in libraries:
        assert re.search(rf"compiled {name}: (built from \S+/site-packages/pdserve/\S+\.c with \S+ in [\d.]+ s"
                         rf"|cached build): \S+/cache/kernels/{name}-", log), f"{name} not loaded:\n{log[-3000:]}"
    assert "unavailable (" not in log and "Traceback" not in log, log[-3000:]


def test_lmcache_is_an_extra_of_the_wheel_not_a_dependency(wheel):
    """A CPU install of the wheel pulls none of the CUDA packages LMCache brings (cupy-cuda13x, cuda-bindings):
    LMCache is the `lmcache` extra (docs/configuration.md, Installing the wheel)."""
    with zipfile.ZipFile(wheel) as archive:
        meta = archive.read("pdserve-0.1.0.dist-info/METADATA").decode()
    requires = [line.partition(":")[2].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    assert [r for r in requires if r.startswith("lmcache")] == ['lmcache==0.5.6; extra == "lmcache"'], requires
    assert "Provides-Extra: lmcache" in meta.splitlines()


def test_without_lmcache_an_lm_store_stops_the_node_with_what_to_install(installed):
    """The installed wheel without LMCache importable: an lm:// store (its server's port answers) stops pd-decode
    with one line naming the extra, no traceback."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        proc = subprocess.run([installed.bin("pd-decode"), "--kv-store", f"lm://127.0.0.1:{server.getsockname()[1]}",
                               "--port", "0", "--grpc-port", "0", "--kv-cache-memory", "64MiB"], cwd=installed.root,
                              env=installed.env, capture_output=True, text=True, timeout=STARTUP_S)
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(errors) == 1 and errors[0].startswith("pd-decode: error: ") and \
        "needs LMCache, which is not installed: pip install 'pdserve[lmcache]'" in errors[0], proc.stderr[-3000:]


def test_site_packages_gains_pdserve_alone_and_imports_come_from_it(installed):
    assert installed.gained == {"pdserve", "pdserve-0.1.0.dist-info"}
    out = json.loads(installed.run([installed.bin("python"), "-c", "import json, pdserve, pdserve.engine, "
                                    "pdserve.kvstore; print(json.dumps([pdserve.__file__, list(pdserve.__path__), "
                                    "pdserve.engine.__file__, pdserve.kvstore.__file__]))"]))
    package = str(installed.site / "pdserve")
    assert out[0] == f"{package}/__init__.py" and out[1] == [package]  # the checkout is not on its path
    assert out[2] == f"{package}/engine/__init__.py" and out[3] == f"{package}/kvstore/__init__.py"


def _offline(installed: Install, **env: str) -> dict:
    """The offline API's greedy answer to PROMPT in the new venv, its attention backend and its libraries."""
    script = f"""
import json
from pdserve import LLM, SamplingParams
from pdserve.common.native_build import loaded_libraries

llm = LLM({str(installed.model)!r}, kv_cache_memory="64MiB")
out = llm.generate([{PROMPT!r}], SamplingParams(max_tokens={MAX_TOKENS}, temperature=0, ignore_eos=True))[0]
print(json.dumps(dict(prompt=out.prompt_token_ids, tokens=out.outputs[0].token_ids, text=out.outputs[0].text,
                      backend=llm.engine.model_runner.attn_backend.name, libraries=loaded_libraries())))
"""
    return json.loads(installed.run([installed.bin("python"), "-c", script], env=env).splitlines()[-1])


@pytest.fixture(scope="module")
def offline(installed) -> dict:
    return _offline(installed)


def test_offline_api_matches_hf_with_compiled_kernels(installed, offline):
    assert offline["tokens"] == hf_greedy(installed.model, [offline["prompt"]], MAX_TOKENS)[0]
    assert offline["backend"] == "cpu"
    assert {"cpu_decode_attention", "cpu_block_ops"} <= set(offline["libraries"]), offline["libraries"]
    # Built into this run's own (fresh) cache from the installed sources: by this engine, or by an earlier command
    # of the run (a node of another test here may have loaded an engine first)
    for entry in offline["libraries"].values():
        assert (entry.startswith(f"built from {installed.site}/pdserve/") or entry.startswith("cached build:")) \
            and f"{installed.root.parent}/cache/kernels/" in entry, entry


def test_without_a_compiler_the_libraries_prebuilt_at_install_serve(installed, offline):
    """What the container image does: `--prebuild` into the installation (<venv>/share/pdserve/kernels; one
    level here, this CPU's widest, to keep it short), then an engine with no working compiler and an empty
    cache loads those and still equals HF token for token."""
    widest = runnable_targets()[0].name
    installed.run([installed.bin("python"), "-m", "pdserve.common.native_build", "--prebuild", "--target", widest])
    got = _offline(installed, CC="/bin/false", PDSERVE_CACHE_DIR=str(installed.root / "empty-cache"))
    assert got["tokens"] == offline["tokens"] and got["backend"] == "cpu"
    assert {"cpu_decode_attention", "cpu_block_ops"} <= set(got["libraries"]), got["libraries"]
    for entry in got["libraries"].values():
        assert entry.startswith(f"prebuilt for {widest}: {installed.venv}/share/pdserve/kernels/"), entry


def test_pd_serve_answers_with_compiled_kernels(installed, offline):
    port = free_port()
    log = installed.start("pd-serve", [installed.bin("pd-serve"), "--port", str(port), "--kv-cache-memory", "64MiB"])
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_for(f"{url}/health", installed.procs, [log], lambda r: True)
        text = _complete(url)
    finally:
        installed.stop_all()
    output = log.read_text()
    assert "attention backend: cpu on cpu" in output
    _compiled_and_no_fallback(output, "cpu_decode_attention", "cpu_block_ops")
    assert text == offline["text"]


def test_prefill_decode_pair_over_a_file_store_loads_kv_with_the_native_reader(installed, offline):
    store = (installed.root / "kvstore").as_uri()
    ports = {name: (free_port(), free_port()) for name in ("prefill", "decode")}
    logs = [installed.start(name, [installed.bin(f"pd-{name}"), "--kv-store", store, "--kv-cache-memory", "64MiB",
                                   "--port", str(http), "--grpc-port", str(grpc)], SHARED_CORES_ENV)
            for name, (http, grpc) in ports.items()]
    proxy = free_port()
    logs.append(installed.start("pd-proxy", [installed.bin("pd-proxy"), "--port", str(proxy),
                                             "--prefill", f"127.0.0.1:{ports['prefill'][1]}",
                                             "--decode", f"127.0.0.1:{ports['decode'][1]}"]))
    try:
        url = f"http://127.0.0.1:{proxy}"
        _wait_for(f"{url}/status", installed.procs, logs,
                  lambda r: all([n["healthy"] for n in r.json()[role]] == [True] for role in ("prefill", "decode")))
        text = _complete(url)
    finally:
        installed.stop_all()
    prefill, decode = (log.read_text() for log in logs[:2])
    assert re.search(r"Stored \d+ tokens", prefill), prefill[-3000:]
    loaded = re.search(r"Retrieved (\d+) tokens", decode)
    assert loaded and int(loaded.group(1)) > 0, decode[-3000:]
    for output in (prefill, decode):
        assert "attention backend: cpu on cpu" in output
        _compiled_and_no_fallback(output, "cpu_decode_attention")
    _compiled_and_no_fallback(decode, "kv_read", "kv_recv")
    assert text == offline["text"]
