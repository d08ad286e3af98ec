"""pdserve's cache directory, the one place that decides where it is.

$PDSERVE_CACHE_DIR, else ~/.cache/pdserve. Below it: `models/` (checkpoints made by pd-make-model),
`kvstore/` (the nodes' default file store), `kernels/` (compiled CPU kernels, keyed by their source).
"""
from __future__ import annotations

import os
from pathlib import Path

ENV = "PDSERVE_CACHE_DIR"


def cache_dir() -> Path:
    return Path(os.environ.get(ENV) or Path.home() / ".cache" / "pdserve")


def models_dir() -> Path:
    return cache_dir() / "models"


def kvstore_dir() -> Path:
    return cache_dir() / "kvstore"


def kernels_dir() -> Path:
    return cache_dir() / "kernels"
