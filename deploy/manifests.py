"""Deploy files as command lines for one host: what deploy.rehearsal runs.

Every container command line in `deploy/compose.yaml` or `deploy/kubernetes/` (what its
kustomization deploys) becomes a Step with the flags it is written with, translated only where one
host differs from many containers: a service name (and 0.0.0.0) becomes 127.0.0.1, each declared
container port a free local port, each volume mount a local directory, and a console script (pd-prefill, ...) this
checkout's entry point. Compose variables (${VAR:-default}) and Kubernetes $(VAR) references
(env, envFrom, ConfigMaps) are expanded as the real tools would. A command line that addresses a
port no service declares, or listens on one its own container does not declare, is an error: that
is a broken deploy file, and it fails here rather than in a cluster.
"""
from __future__ import annotations

import re
import shutil
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pdserve.deploy import kustomize
from pdserve.deploy.processes import HOST, REPO, console_script, free_port
from pdserve.deploy.rehearsal import Probe, Step

PORT_FLAGS = ("--port", "--grpc-port", "-p")  # flags whose value is a port this process listens on
_ADDRESS = re.compile(r"(?<![\w.-])([A-Za-z0-9][\w.-]*):(\d{2,5})(?!\d)")


class DeployFileError(ValueError):
    """A deploy file that could not work as written (unknown port, missing command, ...)."""


def executable(name: str) -> list[str]:
    if name in ("python", "python3"):
        return [sys.executable]
    with open(REPO / "pyproject.toml", "rb") as f:
        if name in tomllib.load(f)["project"]["scripts"]:
            return console_script(name)
    path = shutil.which(name)
    if path is None:
        raise DeployFileError(f"{name} is not installed here (needed to rehearse the deploy files)")
    return [path]


@dataclass
class Localizer:
    """Rewrites one container's command line for this host (see the module docstring)."""

    hosts: dict[str, dict[int, int]]  # DNS name -> {port it serves: local port}
    own_ports: dict[int, int]  # this container's declared ports -> local ports
    paths: dict[str, Path]  # mount path in the container -> local directory
    where: str = ""

    def _address(self, m: re.Match) -> str:
        host, port = m.group(1), int(m.group(2))
        ports = self.own_ports if host in ("0.0.0.0", "127.0.0.1", "localhost") else self.hosts.get(host)
        if ports is None:
            return m.group(0)
        if port not in ports:
            raise DeployFileError(f"{self.where}: {host}:{port} is not a declared port of {host}")
        return f"{HOST}:{ports[port]}"

    def token(self, text: str, previous: str = "") -> str:
        if previous in PORT_FLAGS and text.isdigit():
            if int(text) not in self.own_ports:
                raise DeployFileError(f"{self.where}: listens on {text}, which its container does not declare")
            return str(self.own_ports[int(text)])
        if text == "0.0.0.0":
            return HOST
        for mount, local in self.paths.items():
            if text == mount or text.startswith(mount.rstrip("/") + "/"):
                return str(local) + text[len(mount.rstrip("/")):]
        return _ADDRESS.sub(self._address, text)

    def argv(self, argv: list[str]) -> list[str]:
        if not argv:
            raise DeployFileError(f"{self.where}: no command line")
        out = executable(argv[0])
        for prev, tok in zip(argv, argv[1:]):
            out.append(self.token(tok, prev))
        return out


def _free_ports(ports: list[int]) -> dict[int, int]:
    return {p: free_port() for p in ports}


# ------------------------------------------------------------------ compose

_INTERPOLATION = re.compile(r"\$\$|\$\{(\w+)(?::?-([^}]*))?\}|\$(\w+)")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's variable substitution (${VAR}, ${VAR:-default}, $VAR, $$) on every string of a value."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(3)
        if env.get(name):
            return env[name]
        return m.group(2) or ""
    return _INTERPOLATION.sub(sub, value)


def _compose_ports(service: dict) -> list[int]:
    ports = [int(p) for p in service.get("expose", [])]
    for p in service.get("ports", []):
        ports.append(int(str(p).rsplit(":", 1)[-1].split("/")[0]))
    return sorted(set(ports))


def _depends_on(service: dict) -> dict[str, str]:
    """depends_on in either syntax, as {service: condition}."""
    depends = service.get("depends_on") or {}
    if isinstance(depends, list):
        return {name: "service_started" for name in depends}
    return {name: (spec or {}).get("condition", "service_started") for name, spec in depends.items()}


def compose_steps(path: Path, workdir: Path, env: dict[str, str] | None = None) -> list[Step]:
    """A step per compose service, in the file's order; `after` from depends_on."""
    doc = interpolate(yaml.safe_load(path.read_text()), env or {})
    services: dict[str, dict] = doc["services"]
    hosts = {name: _free_ports(_compose_ports(svc)) for name, svc in services.items()}
    steps = []
    for name, svc in services.items():
        paths = {}
        for volume in svc.get("volumes", []):
            source, _, target = str(volume).partition(":")
            target = target.split(":")[0]
            local = Path(source) if source.startswith(("/", ".")) else workdir / "volumes" / source
            local.mkdir(parents=True, exist_ok=True)
            paths[target] = local
        loc = Localizer(hosts, hosts[name], paths, where=f"compose service {name}")
        command = svc.get("command")
        if not isinstance(command, list):
            raise DeployFileError(f"compose service {name}: write `command` as a list")
        probes = []
        check = svc.get("healthcheck", {}).get("test")
        if check:
            if check[0] != "CMD":
                raise DeployFileError(f"compose service {name}: healthcheck must be [CMD, ...]")
            probes.append(Probe("exec", loc.argv(check[1:])))
        depends = _depends_on(svc)
        # A job is what others wait on to complete (the model writer), not to be healthy.
        one_shot = any(_depends_on(other).get(name) == "service_completed_successfully"
                       for other in services.values())
        steps.append(Step(f"compose-{name}", loc.argv(command), env=dict(svc.get("environment") or {}),
                          probes=probes, one_shot=one_shot, after=[f"compose-{d}" for d in depends],
                          ports=hosts[name], source=list(command)))
    return steps


# ------------------------------------------------------------------ kubernetes

_K8S_VAR = re.compile(r"\$\$|\$\((\w+)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command/args/env values ($$ escapes; unknown names stay)."""
    return _K8S_VAR.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def load_kubernetes(path: Path) -> list[dict]:
    """A directory with a kustomization.yaml: what `kubectl apply -k` creates (deploy/kustomize.py);
    else every manifest of the directory, or the one file."""
    if path.is_dir() and (path / kustomize.FILE).is_file():
        return kustomize.build(path)
    files = sorted(path.glob("*.yaml")) if path.is_dir() else [path]
    return [doc for f in files for doc in yaml.safe_load_all(f.read_text()) if doc]


def _container_env(container: dict, objects: dict[tuple[str, str], dict]) -> dict[str, str]:
    def data(kind: str, name: str, optional: bool = False) -> dict[str, str]:
        obj = objects.get((kind, name))
        if obj is None:
            if optional:
                return {}
            raise DeployFileError(f"container {container['name']} needs {kind} {name}, not in the files")
        return {k: str(v) for k, v in (obj.get("data") or obj.get("stringData") or {}).items()}

    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        ref = source.get("configMapRef") or source.get("secretRef")
        env.update(data("ConfigMap" if "configMapRef" in source else "Secret", ref["name"], ref.get("optional", False)))
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(str(var["value"]), env)
            continue
        ref = var["valueFrom"]
        if "fieldRef" in ref:
            env[var["name"]] = HOST if ref["fieldRef"]["fieldPath"].endswith("IP") else "pdserve-local"
        else:
            key_ref = ref.get("configMapKeyRef") or ref["secretKeyRef"]
            values = data("ConfigMap" if "configMapKeyRef" in ref else "Secret", key_ref["name"],
                          key_ref.get("optional", False))
            if key_ref["key"] in values:
                env[var["name"]] = values[key_ref["key"]]
            elif not key_ref.get("optional"):
                raise DeployFileError(f"{var['name']}: key {key_ref['key']} missing in {key_ref['name']}")
    return env


def _k8s_probe(probe: dict, ports: dict, loc: Localizer) -> Probe:
    def port(ref: Any) -> int:
        if ref not in ports:
            raise DeployFileError(f"{loc.where}: probe port {ref} is not a declared container port")
        return ports[ref]
    if "httpGet" in probe:
        return Probe("http", port=port(probe["httpGet"]["port"]), path=probe["httpGet"].get("path", "/"))
    if "tcpSocket" in probe:
        return Probe("tcp", port=port(probe["tcpSocket"]["port"]))
    return Probe("exec", loc.argv(probe["exec"]["command"]))


def _pods(workload: dict) -> list[str]:
    """Pod names the rehearsal runs: every replica of a StatefulSet (each has its own DNS name,
    `<name>-<i>.<service>`, that others may address); one of a Deployment (its pods are interchangeable)."""
    name = workload["metadata"]["name"]
    if workload["kind"] == "Deployment":
        return [name]
    return [f"{name}-{i}" for i in range(workload["spec"].get("replicas", 1))]


def kubernetes_steps(path: Path, workdir: Path, config: dict[str, dict[str, str]] | None = None) -> list[Step]:
    """A step per container of each pod: init containers one-shot, before their pod's containers.

    Nothing else is ordered, as in Kubernetes: a container that exits is restarted (Step.restart).
    `config` overrides ConfigMap data by name, as an operator would edit it.
    """
    docs = load_kubernetes(path)
    objects = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    for name, data in (config or {}).items():
        objects[("ConfigMap", name)]["data"].update(data)
    workloads = [d for d in docs if d["kind"] in ("StatefulSet", "Deployment")]
    unknown = [d["kind"] for d in docs if d["kind"] not in ("StatefulSet", "Deployment", "Service", "ConfigMap",
                                                             "Secret")]
    if unknown:
        raise DeployFileError(f"cannot rehearse kinds {unknown}")
    # Each container port of each pod gets a local port, by number and by name.
    local: dict[str, dict[Any, int]] = {}
    hosts: dict[str, dict[int, int]] = {}
    for w in workloads:
        for pod in _pods(w):
            ports: dict[Any, int] = {}
            for c in w["spec"]["template"]["spec"]["containers"]:
                for p in c.get("ports", []):
                    ports[p["containerPort"]] = ports[p.get("name", p["containerPort"])] = free_port()
            local[pod] = ports
            if w["kind"] == "StatefulSet":  # the pod's own name under its governing (headless) Service
                hosts[f"{pod}.{w['spec']['serviceName']}"] = {k: v for k, v in ports.items() if isinstance(k, int)}
    for svc in (d for d in docs if d["kind"] == "Service"):
        selector = svc["spec"]["selector"]
        targets = [w for w in workloads
                   if all(w["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in selector.items())]
        if not targets:
            raise DeployFileError(f"Service {svc['metadata']['name']} selects no workload")
        ports = local[_pods(targets[0])[0]]
        hosts[svc["metadata"]["name"]] = {p["port"]: ports[p.get("targetPort", p["port"])]
                                          for p in svc["spec"]["ports"]}
    steps: list[Step] = []
    for w in workloads:
        spec = w["spec"]["template"]["spec"]
        for pod in _pods(w):
            volumes = {}
            for v in spec.get("volumes", []):
                if "emptyDir" not in v:
                    raise DeployFileError(f"{pod}: only emptyDir volumes can be rehearsed, not {v['name']}")
                volumes[v["name"]] = workdir / pod / v["name"]
                volumes[v["name"]].mkdir(parents=True, exist_ok=True)
            previous: list[str] = []
            ports = local[pod]
            numbered = {k: v for k, v in ports.items() if isinstance(k, int)}
            for c in [*spec.get("initContainers", []), *spec["containers"]]:
                init = c in spec.get("initContainers", [])
                where = f"pod {pod} container {c['name']}"
                if "command" not in c:
                    raise DeployFileError(f"{where}: state `command` (the image's entrypoint is not known here)")
                env = _container_env(c, objects)
                paths = {m["mountPath"]: volumes[m["name"]] for m in c.get("volumeMounts", [])}
                loc = Localizer(hosts, numbered, paths, where)
                source = [expand(t, env) for t in [*c["command"], *c.get("args", [])]]
                probes = [_k8s_probe(c[k], ports, loc) for k in ("readinessProbe", "startupProbe", "livenessProbe")
                          if k in c]
                step = Step(f"{pod}-{c['name']}", loc.argv(source), env=env, probes=probes, one_shot=init,
                            after=list(previous), ports=numbered, source=source, restart=not init)
                if init:
                    previous.append(step.name)
                steps.append(step)
    return steps
