"""The deploy files must not rot: deploy/compose.yaml and deploy/kubernetes/ (what its kustomization
deploys) validate offline against the compose spec and the Kubernetes schemas, the kustomization is the
one place that names the image, the flags every node must agree on agree, and every command line in them
runs here (deploy.rehearsal: same flags, local ports) until the file's own health checks pass and a
request through the proxy comes back exact, its KV handed over in Redis."""
from __future__ import annotations

import copy
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import kubernetes_validate
import pytest
import yaml

from pdserve.deploy import kustomize
from pdserve.deploy.manifests import DeployFileError, compose_steps, kubernetes_steps, load_kubernetes
from pdserve.deploy.processes import REPO
from pdserve.deploy.rehearsal import Rehearsal
from tests.helpers.connector import hf_greedy

COMPOSE = REPO / "deploy" / "compose.yaml"
KUBERNETES = REPO / "deploy" / "kubernetes"
# The flags whose values must be equal on every prefill and decode node (store layout and KV identity).
SHARED_FLAGS = ("--model", "--dtype", "--block-size", "--chunk-size", "--kv-store")
NODES = ("pd-prefill", "pd-decode")


def _check_compose(path: Path) -> subprocess.CompletedProcess:
    """check-jsonschema against the compose spec it bundles (no network)."""
    return subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
                           str(path)], capture_output=True, text=True, timeout=60)


def test_compose_file_validates_against_the_compose_spec(tmp_path):
    proc = _check_compose(COMPOSE)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    broken = yaml.safe_load(COMPOSE.read_text())
    broken["services"]["prefill"]["healthcheck"]["intervall"] = "5s"  # a typo the spec must catch
    (tmp_path / "compose.yaml").write_text(yaml.safe_dump(broken))
    assert _check_compose(tmp_path / "compose.yaml").returncode != 0


def test_kubernetes_manifests_validate_against_the_kubernetes_schemas():
    version = kubernetes_validate.latest_version()
    docs = load_kubernetes(KUBERNETES)
    kinds = sorted({d["kind"] for d in docs})
    assert kinds == ["ConfigMap", "Deployment", "Service", "StatefulSet"]  # the proxy is the Deployment
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)
    broken = copy.deepcopy(next(d for d in docs if d["kind"] == "Deployment"))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/health"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, version, strict=True)


def _pdserve_containers(docs: list[dict]) -> list[dict]:
    pods = [d["spec"]["template"]["spec"] for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    return [c for p in pods for c in p.get("initContainers", []) + p["containers"] if c["command"][0] != "redis-server"]


def test_the_kustomization_is_the_one_image_setting(tmp_path):
    """`kubectl apply -k deploy/kubernetes/` deploys every manifest there, and the image every pdserve container
    runs is named once, in kustomization.yaml: the manifests say just `pdserve`. Pointing the kustomization at
    a registry moves every pdserve container there and nothing else."""
    k = kustomize.load(KUBERNETES)
    assert sorted(k["resources"]) == sorted(p.name for p in KUBERNETES.glob("*.yaml") if p.name != kustomize.FILE)
    assert [i["name"] for i in k["images"]] == ["pdserve"]
    raw = [doc for name in k["resources"] for doc in yaml.safe_load_all((KUBERNETES / name).read_text()) if doc]
    assert {c["image"] for c in _pdserve_containers(raw)} == {"pdserve"}  # no tag or registry in a manifest
    image = f"{k['images'][0]['newName']}:{k['images'][0]['newTag']}"
    assert {c["image"] for c in _pdserve_containers(load_kubernetes(KUBERNETES))} == {image}
    # An operator's registry: copy the directory, change the kustomization only.
    mine = tmp_path / "kubernetes"
    shutil.copytree(KUBERNETES, mine)
    edited = yaml.safe_load((mine / kustomize.FILE).read_text())
    edited["images"][0].update(newName="registry.example.com:5000/team/pdserve", newTag="0.1.1")
    (mine / kustomize.FILE).write_text(yaml.safe_dump(edited))
    docs = load_kubernetes(mine)
    assert {c["image"] for c in _pdserve_containers(docs)} == {"registry.example.com:5000/team/pdserve:0.1.1"}
    assert len(_pdserve_containers(docs)) == 5  # prefill and decode (each with its init container), proxy
    redis = next(d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "pdserve-redis")
    assert redis["spec"]["template"]["spec"]["containers"][0]["image"] == "redis:7"
    for doc in docs:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


@pytest.mark.parametrize("change,error", [
    ({"namespace": "prod"}, "not understood here"),  # kustomize would apply it; the rehearsal would not
    ({"resources": ["prefill.yaml", "nope.yaml"]}, "'nope.yaml' is not a file"),
    ({"images": [{"name": "pdserve", "newTagg": "1"}]}, "an images entry needs name and only"),
    ({"kind": "Deployment"}, "not a kustomize.config.k8s.io/v1beta1 Kustomization"),
])
def test_a_kustomization_it_cannot_follow_is_an_error(tmp_path, change, error):
    mine = tmp_path / "kubernetes"
    shutil.copytree(KUBERNETES, mine)
    doc = {**yaml.safe_load((mine / kustomize.FILE).read_text()), **change}
    (mine / kustomize.FILE).write_text(yaml.safe_dump(doc))
    with pytest.raises(kustomize.KustomizationError, match=error):
        load_kubernetes(mine)


@pytest.mark.parametrize("image,want", [
    ("pdserve", ("pdserve", None, None)), ("pdserve:0.1.0", ("pdserve", "0.1.0", None)),
    ("reg:5000/team/pdserve:1", ("reg:5000/team/pdserve", "1", None)),
    ("reg:5000/pdserve@sha256:ab", ("reg:5000/pdserve", None, "sha256:ab"))])
def test_image_references_split_as_kustomize_reads_them(image, want):
    assert kustomize.split_image(image) == want


def _flags(argv: list[str]) -> dict[str, str | None]:
    return {flag: argv[argv.index(flag) + 1] if flag in argv else None for flag in SHARED_FLAGS}


def test_nodes_agree_and_kubernetes_takes_shared_flags_from_the_configmap(tmp_path):
    for steps in (compose_steps(COMPOSE, tmp_path / "c"), kubernetes_steps(KUBERNETES, tmp_path / "k")):
        nodes = [s for s in steps if s.source[0] in NODES]
        assert {s.source[0] for s in nodes} == set(NODES)
        assert len({tuple(_flags(s.source).items()) for s in nodes}) == 1, [_flags(s.source) for s in nodes]
    config = next(d for d in load_kubernetes(KUBERNETES) if d["kind"] == "ConfigMap")["data"]
    for doc in load_kubernetes(KUBERNETES):
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for c in doc["spec"]["template"]["spec"]["containers"]:
            if c["command"][0] in NODES:
                flags = _flags(c["args"])
                assert all(v and v.startswith("$(PDSERVE_") and v[2:-1] in config for v in flags.values()), flags
    # A file that addresses a port nobody declares is caught, not silently run.
    broken = yaml.safe_load(COMPOSE.read_text())
    broken["services"]["proxy"]["command"][-1] = "decode:50099"
    (tmp_path / "broken.yaml").write_text(yaml.safe_dump(broken))
    with pytest.raises(DeployFileError, match="decode:50099"):
        compose_steps(tmp_path / "broken.yaml", tmp_path / "b")


def _redis_keys(port: int) -> int:
    out = subprocess.run(["redis-cli", "-p", str(port), "dbsize"], capture_output=True, text=True, timeout=10)
    return int(out.stdout.strip())


def _wait_all_nodes_in_rotation(url: str, steps, timeout_s: float = 60.0) -> None:
    """The proxy is ready with one healthy decode node; this request must go through a prefill node."""
    want = {role: sum(s.source[0] == f"pd-{role}" for s in steps) for role in ("prefill", "decode")}
    deadline = time.monotonic() + timeout_s
    while True:
        got = httpx.get(url + "/health", timeout=10).json()
        if all(got[role] == n for role, n in want.items()):
            return
        assert time.monotonic() < deadline, f"nodes in the proxy's rotation: {got}, want {want}"
        time.sleep(0.2)


def _rehearse(steps, tmp_path: Path, proxy: str, redis: str, security_line: str) -> None:
    """Run every step until up, then one exact request through the proxy whose KV went through Redis."""
    rehearsal = Rehearsal(steps, tmp_path / "logs", {"PDSERVE_CACHE_DIR": str(tmp_path / "cache")})
    rehearsal.start(timeout_s=500)  # a loaded 2-core machine; about 30 s when quiet
    try:
        by_name = {s.name: s for s in steps}
        url = f"http://127.0.0.1:{by_name[proxy].ports[8000]}"
        _wait_all_nodes_in_rotation(url, steps)
        prompt = [(7 * i) % 250 + 3 for i in range(300)]  # one full 256-token chunk and a partial one
        r = httpx.post(url + "/v1/completions", timeout=120, json={
            "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "return_token_ids": True})
        assert r.status_code == 200, r.text
        decode = next(s for s in steps if s.source[0] == "pd-decode")
        model = Path(decode.argv[decode.argv.index("--model") + 1])
        assert r.json()["choices"][0]["token_ids"] == hf_greedy(model, [prompt], 4)[0]
        assert _redis_keys(by_name[redis].ports[6379]) > 0  # the prefill node saved the prompt's KV there
        decode_logs = "".join((tmp_path / "logs" / f"{s.name}.out").read_text() for s in steps
                              if s.source[0] == "pd-decode")
        assert "KV hit tokens: 300" in decode_logs, decode_logs[-2000:]
        assert security_line in decode_logs  # TLS and the key are optional in the files
    finally:
        rehearsal.stop()


@pytest.mark.slow
@pytest.mark.release  # every node of the files started for real: a release check
def test_compose_command_lines_run_until_healthy(tmp_path):
    """With PDSERVE_NODE_API_KEY set, as an operator would: nodes require the key, the proxy sends it."""
    steps = compose_steps(COMPOSE, tmp_path / "work", {"PDSERVE_NODE_API_KEY": "compose-key"})
    _rehearse(steps, tmp_path, "compose-proxy", "compose-redis", "API key required, but sent in clear text")


@pytest.mark.slow
@pytest.mark.release  # every node of the files started for real: a release check
def test_kubernetes_command_lines_run_until_ready(tmp_path):
    steps = kubernetes_steps(KUBERNETES, tmp_path / "work")
    assert sum(s.source[0] in NODES for s in steps) == 4  # both replicas of both StatefulSets
    _rehearse(steps, tmp_path, "pdserve-proxy-proxy", "pdserve-redis-0-redis", "is plaintext and unauthenticated")
