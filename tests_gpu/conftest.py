"""The GPU suite: run by `make test-gpu` on a machine with a CUDA device (never by `make test`).

Nothing here skips: without a CUDA device every test errors at its first fixture, with the reason.
Models are random-weight checkpoints written by pd-make-model into a session temp dir.
"""
from __future__ import annotations

import os
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels: before triton is first imported
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def cuda_device() -> torch.device:
    assert torch.cuda.is_available(), (f"tests_gpu needs a CUDA device; torch {torch.__version__} sees none "
                                       "(the CPU suite is `make test`)")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 must be fp32 for the HF comparisons
    torch.backends.cudnn.allow_tf32 = False
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture(scope="session")
def fp32_model(tmp_path_factory) -> Path:
    """The `bench` preset (12 layers, hidden 1024, GQA 2) in fp32, for exact greedy comparisons."""
    from pdserve.engine.builtin_model import make_model

    return make_model(tmp_path_factory.mktemp("bench-fp32"), preset="bench", dtype="float32")


@pytest.fixture(scope="session")
def bf16_model(tmp_path_factory) -> Path:
    from pdserve.engine.builtin_model import make_model

    return make_model(tmp_path_factory.mktemp("bench-bf16"), preset="bench")


@pytest.fixture()
def redis_server():
    from pdserve.deploy.redis_servers import RedisServer

    server = RedisServer()
    server.start()
    yield server
    server.stop()
