"""Every flag's help quotes the default the command really applies: a config dataclass's (engine/config.py,
ProxyConfig, Deadlines, HttpTimeouts) where the dataclass owns it, else the parser's own."""
from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any

import pytest

from pdserve.common import env
from pdserve.common.units import format_bytes
from pdserve.engine.config import (DEFAULT_GPU_MEMORY_UTILIZATION, DEFAULT_KV_CACHE_MEMORY, CacheConfig, DeviceConfig,
                                   KVTransferConfig, LoRAConfig, ModelConfig, ParallelConfig, SchedulerConfig)
from pdserve.proxy.__main__ import build_parser as proxy_parser
from pdserve.proxy.app import ProxyConfig
from pdserve.proxy.decode_stream import Deadlines
from pdserve.serving.cli import config_default
from pdserve.serving.limits import HttpTimeouts
from pdserve.serving.node import build_parser as node_parser
from pdserve.serving.server import build_parser as serve_parser

ENGINE = (ModelConfig, CacheConfig, SchedulerConfig, KVTransferConfig, DeviceConfig, ParallelConfig, LoRAConfig)
# flag dest -> (dataclass, field) where the names differ from the field's
OWNERS: dict[str, tuple[type, str]] = {
    "policy": (ProxyConfig, "policy"), "local_prefill_threshold": (ProxyConfig, "local_prefill_threshold"),
    "health_interval": (ProxyConfig, "health_interval_s"), "prefill_timeout": (ProxyConfig, "prefill_timeout_s"),
    "connect_timeout": (Deadlines, "connect_s"), "first_token_timeout": (Deadlines, "first_token_s"),
    "token_timeout": (Deadlines, "token_s"), "decode_recovery_timeout": (Deadlines, "recovery_s"),
    "stall_timeout": (Deadlines, "stall_s"), "timeout_request_header": (HttpTimeouts, "header_s"),
    "timeout_request_body": (HttpTimeouts, "body_s"), "timeout_keep_alive": (HttpTimeouts, "keep_alive_s"),
}
# fields whose None the engine resolves to a constant of engine/config.py
RESOLVED = {"kv_cache_memory": format_bytes(DEFAULT_KV_CACHE_MEMORY),
            "gpu_memory_utilization": DEFAULT_GPU_MEMORY_UTILIZATION}
QUOTED = re.compile(r"(?:\(|; )default (\S+?)[:;,)]*(?:\s|$)")  # "(default 16)"; "(default: prose)" quotes none


def _owner(dest: str) -> tuple[type, str] | None:
    if dest in OWNERS:
        return OWNERS[dest]
    return next(((cls, dest) for cls in ENGINE for f in dataclasses.fields(cls)
                 if f.name == dest and f.default is not dataclasses.MISSING), None)


def _text(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _parsers() -> dict[str, tuple[argparse.ArgumentParser, dict[str, Any]]]:
    """Each command's parser, and the defaults its entry point resolves itself (a node's role)."""
    from pdserve.decode_node.__main__ import ROLE as decode
    from pdserve.prefill_node.__main__ import ROLE as prefill

    return {"pd-serve": (serve_parser(), {}), "pd-prefill": (node_parser(prefill), {"kv_role": prefill.kv_role}),
            "pd-decode": (node_parser(decode), {"kv_role": decode.kv_role}), "pd-proxy": (proxy_parser(), {})}


@pytest.fixture(autouse=True)
def _no_key_variables(monkeypatch):
    """A key set in the environment is the parser's default: its help names the variable, not the key."""
    for var in (env.API_KEY, env.NODE_API_KEY):
        monkeypatch.delenv(var.name, raising=False)


@pytest.mark.parametrize("prog", ["pd-serve", "pd-prefill", "pd-decode", "pd-proxy"])
def test_every_quoted_default_is_the_one_applied(prog):
    parser, resolved = _parsers()[prog]
    checked = []
    for action in parser._actions:
        owner = _owner(action.dest)
        owned = config_default(*owner) if owner else None
        if owner and action.default is not None:  # the parser repeats it: it must be the dataclass's value
            assert action.default == owned, f"{prog} {action.option_strings}: {action.default} != {owner}"
        applied = action.default if action.default is not None else owned
        applied = {**RESOLVED, **resolved}.get(action.dest) if applied is None else applied
        quoted = QUOTED.search(action.help or "")
        if quoted is None or applied is None or isinstance(applied, bool):
            continue
        assert quoted.group(1) == _text(applied), f"{prog} {action.option_strings}: help says {quoted.group(0)!r}"
        checked.append(action.dest)
    # the flags with a value to quote, all of them checked (a help that stops quoting its default fails here)
    expected = {"host", "port", "log_level", "timeout_request_header", "timeout_request_body", "timeout_keep_alive"}
    if prog == "pd-proxy":
        expected |= {"policy", "local_prefill_threshold", "health_interval", "prefill_timeout", "connect_timeout",
                     "first_token_timeout", "token_timeout", "stall_timeout"}
    else:
        expected |= {"max_waiting_requests", "shutdown_timeout", "dtype", "block_size", "device", "attention_backend",
                     "kv_cache_memory", "gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens",
                     "long_prefill_token_threshold", "seed", "tensor_parallel_size", "pipeline_parallel_size"}
    if prog in ("pd-prefill", "pd-decode"):
        expected |= {"grpc_port", "chunk_size", "kv_role", "load_timeout_s"}
    assert expected <= set(checked), sorted(expected - set(checked))


def test_engine_flags_leave_their_defaults_to_engine_config():
    """A flag of an EngineConfig field parses to None when not given, so the dataclass's default applies
    (engine_kwargs_from_args passes only what was set): the parser holds no second copy to drift."""
    for prog, (parser, _) in _parsers().items():
        for action in parser._actions:
            owner = _owner(action.dest)
            if owner is not None and owner[0] in ENGINE:
                assert action.default is None, f"{prog} {action.option_strings} defaults to {action.default!r}"
