"""Session fixtures: tiny random checkpoints and a real redis-server."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Triton reads TRITON_INTERPRET when it is first imported (its own tl.* helpers are jitted then),
# and lmcache/transformers may import it early: set it before anything else so the kernel tests
# run in the interpreter whatever the test order. CPU tensors still take the torch path.
os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.utils import RedisServer  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    from engine.builtin_model import make_model

    path = tmp_path_factory.mktemp("tiny-llama")
    make_model(path, preset="tiny", arch="llama")
    return path


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    from engine.builtin_model import make_model

    path = tmp_path_factory.mktemp("tiny-qwen2")
    make_model(path, preset="tiny", arch="qwen2")
    return path


@pytest.fixture()
def redis_server():
    server = RedisServer()
    server.start()
    yield server
    server.stop()
