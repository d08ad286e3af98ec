"""The objects `kubectl apply -k DIR` creates from deploy/kubernetes/, without kubectl: the files its
kustomization.yaml lists under `resources`, with its `images` applied.

Only what our kustomization uses is understood (resources that are files in DIR, and images); any other
field is an error here, so the rehearsal and the schema tests never check something other than what
kustomize would deploy. `images` works as kustomize's: an entry matches a container or init container
whose image name (without tag or digest) equals its `name`, and replaces the name with `newName` and the
tag with `newTag` (or the digest with `digest`), each when given.
"""
from __future__ import annotations

from pathlib import Path

import yaml

FILE = "kustomization.yaml"
API_VERSION = "kustomize.config.k8s.io/v1beta1"
_FIELDS = {"apiVersion", "kind", "resources", "images"}
_IMAGE_FIELDS = {"name", "newName", "newTag", "digest"}


class KustomizationError(ValueError):
    pass


def load(directory: Path) -> dict:
    """The kustomization of `directory`, checked to hold only what `build` applies."""
    path = directory / FILE
    doc = yaml.safe_load(path.read_text())
    if not isinstance(doc, dict) or doc.get("apiVersion") != API_VERSION or doc.get("kind") != "Kustomization":
        raise KustomizationError(f"{path}: not a {API_VERSION} Kustomization")
    if unknown := sorted(set(doc) - _FIELDS):
        raise KustomizationError(f"{path}: fields {unknown} are not understood here (only {sorted(_FIELDS)})")
    resources = doc.get("resources")
    if not isinstance(resources, list) or not resources:
        raise KustomizationError(f"{path}: resources must list the manifests")
    for name in resources:
        if not isinstance(name, str) or "/" in name or not (directory / name).is_file():
            raise KustomizationError(f"{path}: resource {name!r} is not a file beside it")
    for entry in doc.get("images", []):
        if not isinstance(entry, dict) or "name" not in entry or set(entry) - _IMAGE_FIELDS:
            raise KustomizationError(f"{path}: an images entry needs name and only {sorted(_IMAGE_FIELDS)}: {entry}")
    return doc


def split_image(image: str) -> tuple[str, str | None, str | None]:
    """(name, tag, digest) of an image reference; a registry's port is part of the name."""
    name, _, digest = image.partition("@")
    last = name.rsplit("/", 1)[-1]
    tag = None
    if ":" in last:
        name, tag = name.rsplit(":", 1)
    return name, tag, digest or None


def set_image(image: str, images: list[dict]) -> str:
    name, tag, digest = split_image(image)
    for entry in images:
        if entry["name"] == name:
            name = entry.get("newName", name)
            tag = str(entry["newTag"]) if "newTag" in entry else tag
            digest = entry.get("digest", digest)
            break
    return name + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")


def build(directory: Path) -> list[dict]:
    """Every object the kustomization creates, in the order of its resources."""
    kustomization = load(directory)
    images = kustomization.get("images", [])
    docs = [doc for name in kustomization["resources"]
            for doc in yaml.safe_load_all((directory / name).read_text()) if doc]
    for doc in docs:
        pod = doc.get("spec", {}).get("template", {}).get("spec", {})
        for container in pod.get("initContainers", []) + pod.get("containers", []):
            container["image"] = set_image(container["image"], images)
    return docs
