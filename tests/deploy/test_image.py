"""deploy/Dockerfile builds with podman and its image serves: the entry points installed in it start,
load the built-in model and answer a request, on the compiled CPU kernels its build stage prebuilt
(the image itself has no C compiler).

No container registry is reachable here, so the Dockerfile's BASE is a Debian bookworm root file
system made with debootstrap from the Debian mirror apt uses (python3 3.11 + venv, like the default
python:3.11-slim), imported once into podman's store and reused. pip inside the build uses this
host's pip settings (index, wheel directories, CA bundle), mounted read-only. Two quirks of this
machine, harmless elsewhere: crun refuses its hybrid cgroup layout (runc does not), and containers
cannot raise resource limits (no CAP_SYS_RESOURCE), so they get limits below the current ones.
"""
from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from pdserve.common.native_build import sources
from pdserve.deploy.processes import REPO, free_port

pytestmark = [
    pytest.mark.container,
    pytest.mark.release,  # minutes of image build: the release checks it (make test-release), not every change
    pytest.mark.root("debootstraps the Debian base image and builds with podman's runc"),
    pytest.mark.network("deb.debian.org:80", "debootstraps the Debian base image from deb.debian.org, and pip in "
                        "the build reaches this host's package index"),
]

BASE = "localhost/pdserve-base:bookworm"
IMAGE = "localhost/pdserve:test"  # + "-" + the build context's digest
PODMAN = ["podman", "--runtime", "runc"]
LIMITS = ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1000:1000"]
DEBIAN_MIRROR = "http://deb.debian.org/debian"


def _run(argv: list[str], timeout_s: float, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, **kw)
    assert proc.returncode == 0, f"{' '.join(argv[:6])} ... exited {proc.returncode}:\n{proc.stdout[-3000:]}" \
                                 f"\n{proc.stderr[-3000:]}"
    return proc


def _base_image() -> None:
    if subprocess.run(PODMAN + ["image", "exists", BASE]).returncode == 0:
        return
    with tempfile.TemporaryDirectory(dir="/var/tmp") as root:
        _run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv", "bookworm", root,
              DEBIAN_MIRROR], 900)
        tar = subprocess.Popen(["tar", "-C", root, "-c", "."], stdout=subprocess.PIPE)
        _run(PODMAN + ["import", "-", BASE], 300, stdin=tar.stdout)
        assert tar.wait() == 0


def _pip_build_args() -> tuple[list[str], list[str]]:
    """(--build-arg ..., -v ...) carrying this host's pip settings into the build."""
    config = _run([sys.executable, "-m", "pip", "config", "list"], 60).stdout
    settings = {}
    for line in config.splitlines():
        key, _, value = line.partition("=")
        settings[key.rsplit(".", 1)[-1]] = value.strip("'")
    args, mounts, paths = [], [], set()
    for key in ("index-url", "extra-index-url", "find-links"):
        if settings.get(key):
            args += ["--build-arg", f"PIP_{key.upper().replace('-', '_')}={settings[key]}"]
            for value in settings[key].split():
                if not value.startswith("http"):  # a local index's files lie beside its simple/ directory
                    path = Path(value.removeprefix("file://").rstrip("/"))
                    paths.add(str(path.parent if key != "find-links" and path.name == "simple" else path))
    if settings.get("cert"):
        args += ["--build-arg", "PIP_CERT=/run/pip-cert.pem"]
        mounts += ["-v", f"{settings['cert']}:/run/pip-cert.pem:ro"]
    for path in sorted(p for p in paths if Path(p).exists()):
        mounts += ["-v", f"{path}:{path}:ro"]
    return args, mounts


def _context_digest() -> str:
    """What the image is built from: every file of the checkout git does not ignore (the build context), by
    content. An image tagged with it was built from exactly this tree and need not be built again."""
    names = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], 60, cwd=REPO).stdout
    digest = hashlib.sha256()
    for name in sorted(set(filter(None, names.split("\0")))):
        path = REPO / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _built_image() -> str:
    """The image of this checkout: built once per build context (_context_digest), then reused."""
    image = f"{IMAGE}-{_context_digest()}"
    if subprocess.run(PODMAN + ["image", "exists", image]).returncode == 0:
        return image
    _base_image()
    args, mounts = _pip_build_args()
    _run(PODMAN + ["build", "--network", "host", *LIMITS, *mounts, "--build-arg", f"BASE={BASE}",
                   "--build-arg", "TORCH_PIP_ARGS=", *args, "-t", image, "-f", "deploy/Dockerfile", "."],
         3000, cwd=REPO)
    return image


@pytest.mark.timeout(3600)  # the first build installs torch and every dependency; later ones reuse the layers
def test_podman_builds_the_image_and_it_serves():
    image = _built_image()
    for command in ("pd-prefill", "pd-decode", "pd-proxy", "pd-kvstore"):
        out = _run(PODMAN + ["run", "--rm", *LIMITS, image, command, "--help"], 120).stdout
        assert f"usage: {command}" in out
    compilers = _run(PODMAN + ["run", "--rm", *LIMITS, image, "python", "-c",
                               "import shutil; print([shutil.which(c) for c in ('cc', 'gcc', 'clang')])"], 120).stdout
    assert compilers.strip() == "[None, None, None]"
    # Every C source of the checkout (kernels/csrc, kvstore/csrc) loads there, prebuilt for this host's CPU.
    loads = _run(PODMAN + ["run", "--rm", *LIMITS, image, "python", "-m", "pdserve.common.native_build"], 120).stdout
    for source in sources():
        where = rf"^{source.stem}: prebuilt for x86-64\S*: /opt/pdserve/share/pdserve/kernels/"
        assert re.search(where, loads, re.M), loads
    port = free_port()
    name = f"pdserve-test-{port}"
    _run(PODMAN + ["run", "-d", "--name", name, "--network", "host", *LIMITS, image, "pd-serve", "--host",
                   "127.0.0.1", "--port", str(port), "--kv-cache-memory", "64MiB"], 120)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            state = _run(PODMAN + ["inspect", "-f", "{{.State.Running}}", name], 30).stdout.strip()
            logs = subprocess.run(PODMAN + ["logs", name], capture_output=True, text=True).stderr
            assert state == "true" and time.monotonic() < deadline, f"pd-serve in the image did not start:\n{logs}"
            time.sleep(1)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        logs = subprocess.run(PODMAN + ["logs", name], capture_output=True, text=True, timeout=60)
        log = logs.stdout + logs.stderr
        assert "attention backend: cpu on cpu" in log and "unavailable (" not in log, log[-3000:]
        for library in ("cpu_decode_attention", "cpu_block_ops"):  # the serving engine's compiled paths
            assert re.search(rf"compiled {library}: prebuilt for x86-64", log), log[-3000:]
        user = _run(PODMAN + ["exec", name, "id", "-u"], 30).stdout.strip()
        assert user == "10001"  # not root
    finally:
        subprocess.run(PODMAN + ["rm", "-f", "-t", "5", name], capture_output=True, timeout=60)
