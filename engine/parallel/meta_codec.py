"""The connector's per-step metadata as JSON bytes for the other ranks (never pickle).

The metadata is a tree of dataclasses, lists, dicts, plain values and small tensors (slots). A dataclass
node carries its class as `module:qualname`; decoding imports only dataclasses of pdserve's own modules,
so a message can make nothing but pdserve's plain data objects.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
from typing import Any

import torch

_CLASS, _TENSOR = "__dataclass__", "__tensor__"


def _plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        node = {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
        node[_CLASS] = f"{type(obj).__module__}:{type(obj).__qualname__}"
        return node
    if isinstance(obj, torch.Tensor):
        return {_TENSOR: str(obj.dtype).removeprefix("torch."), "data": obj.cpu().tolist()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot send {type(obj).__name__} to the other ranks")


def _class(name: str) -> type:
    module, _, qualname = name.partition(":")
    if not module.startswith("pdserve."):
        raise ValueError(f"refusing to build {name!r}: not a pdserve class")
    cls: Any = importlib.import_module(module)
    for part in qualname.split("."):
        cls = getattr(cls, part)
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise ValueError(f"refusing to build {name!r}: not a dataclass")
    return cls


def _restore(node: Any) -> Any:
    if isinstance(node, list):
        return [_restore(v) for v in node]
    if not isinstance(node, dict):
        return node
    if _TENSOR in node:
        return torch.tensor(node["data"], dtype=getattr(torch, node[_TENSOR]))
    fields = {k: _restore(v) for k, v in node.items() if k != _CLASS}
    return _class(node[_CLASS])(**fields) if _CLASS in node else fields


def encode(obj: Any) -> bytes:
    return json.dumps(_plain(obj), separators=(",", ":")).encode()


def decode(data: bytes) -> Any:
    return _restore(json.loads(data))
