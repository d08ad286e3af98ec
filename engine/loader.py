"""Checkpoint weights from safetensors files: a single `model.safetensors` or a sharded index."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The files holding the weights, in a stable order; an index names its shards."""
    root = Path(model_dir)
    index = root / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [root / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise ValueError(f"{index} names shards that do not exist: {', '.join(missing)}")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {root} (only safetensors checkpoints are supported)")
    return files


def iterate_weights(model_dir: str | Path,
                    device: torch.device | str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the checkpoint, read one at a time straight onto `device`
    (memory-mapped on the host; no whole-model host copy on the way to a GPU)."""
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
