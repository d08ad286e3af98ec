"""pdserve's cache directory, the one place that decides where it is.

$PDSERVE_CACHE_DIR, else ~/.cache/pdserve. Below it: `models/` (checkpoints made by pd-make-model),
`kvstore/` (the nodes' default file store), `kernels/` (compiled CPU kernels, keyed by their source).
Libraries prebuilt at install (common/native_build.py) lie with the installation instead, under
<sys.prefix>/share/pdserve/kernels, where a cache directory mounted over the default cannot hide them.
"""
from __future__ import annotations

import sys
from pathlib import Path

from pdserve.common import env

ENV = env.CACHE_DIR.name


def cache_dir() -> Path:
    return env.path(env.CACHE_DIR)


def models_dir() -> Path:
    return cache_dir() / "models"


def kvstore_dir() -> Path:
    return cache_dir() / "kvstore"


def kernels_dir() -> Path:
    return cache_dir() / "kernels"


def prebuilt_kernels_dir() -> Path:
    return Path(sys.prefix) / "share" / "pdserve" / "kernels"
