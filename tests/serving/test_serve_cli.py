"""Start-up from the command line: pd-serve's failures (one line on stderr, non-zero exit, no traceback),
and vLLM's --kv-transfer-config JSON on the node commands, rejected or mapped onto pdserve's KV flags."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time

import pytest

from pdserve.decode_node.__main__ import ROLE as DECODE
from pdserve.deploy.processes import console_script, free_port
from pdserve.deploy.server_process import PD_SERVE, ServerProcess
from pdserve.prefill_node.__main__ import ROLE as PREFILL
from pdserve.serving.node import node_main
from tests.helpers.timing import HANG_S


def _run(*args: str) -> tuple[int, list[str]]:
    proc = subprocess.run([*PD_SERVE, "--port", "0", *args], capture_output=True, text=True, timeout=120,
                          env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    return proc.returncode, (proc.stdout + proc.stderr).strip().splitlines()


@pytest.mark.parametrize("args,fragment", [
    (["--block-size", "abc"], "--block-size: expected an integer, got 'abc'"),
    (["--max-num-seqs", "0"], "--max-num-seqs: expected an integer >= 1, got 0"),
    (["--dtype", "float8"], "--dtype: invalid choice"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_bad_flag_is_one_line_exit_2(args, fragment):
    rc, lines = _run(*args)
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("pd-serve: error:") and fragment in lines[0]


@pytest.mark.parametrize("args,message", [
    (["--block-size", "3"], "block_size must be a power of two, got 3"),
    (["--kv-cache-memory", "3XB"], "cannot parse a byte size from '3XB' (use e.g. 2GiB, 512MiB, 1000000)"),
])
def test_invalid_engine_option(args, message):
    rc, lines = _run(*args)
    assert rc == 1 and lines == [f"pd-serve: error: invalid engine option: {message}"]


def test_missing_model_dir(tmp_path):
    rc, lines = _run("--model", str(tmp_path / "nope"))
    assert rc == 1 and lines == [f"pd-serve: error: model directory {tmp_path / 'nope'} does not exist or is "
                                 "not a directory"]


def test_model_dir_without_config(tmp_path):
    rc, lines = _run("--model", str(tmp_path))
    assert rc == 1 and lines == [f"pd-serve: error: model directory {tmp_path} is not readable or has no "
                                 "config.json"]


@pytest.mark.slow  # seconds: outside make test-quick
def test_corrupt_model_dir(tmp_path):
    (tmp_path / "config.json").write_text("{ this is not json")
    rc, lines = _run("--model", str(tmp_path))
    assert rc == 1 and len(lines) == 1, lines
    assert lines[0].startswith(f"pd-serve: error: cannot load model from {tmp_path}: ")


def test_port_in_use(tiny_llama):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        rc, lines = _run("--model", str(tiny_llama), "--port", str(s.getsockname()[1]))
    assert rc == 1 and len(lines) == 1 and lines[0].startswith("pd-serve: error: cannot listen on 127.0.0.1:")


@pytest.mark.parametrize("prog,args,value", [
    ("pd-serve", ["--port"], "70000"),
    ("pd-prefill", ["--port"], "70000"),
    ("pd-prefill", ["--grpc-port"], "70000"),
    ("pd-decode", ["--grpc-port"], "-1"),
    ("pd-decode", ["--port"], "http"),
    ("pd-proxy", ["--decode", "127.0.0.1:1", "--port"], "70000"),
])
def test_a_port_outside_0_to_65535_is_one_line_exit_2(tiny_llama, prog, args, value):
    """Every port flag of every command is a port to argparse: a usage error, not a traceback from bind()
    (nor a node that loads its model first: the model here is a real one)."""
    model = [] if prog == "pd-proxy" else ["--model", str(tiny_llama)]
    proc = subprocess.run([*console_script(prog), *model, *args, value], capture_output=True, text=True,
                          timeout=HANG_S, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2 and lines == [f"{prog}: error: argument {args[-1]}: a port is 0..65535, got "
                                              f"{value!r} (see --help)"], lines


def test_a_redis_store_url_whose_path_is_no_database_stops_the_node(tiny_llama, redis_server):
    """`--kv-store redis://host:port/abc` against a redis that answers: one line and exit 1 before the model
    loads, not a node serving from database 0."""
    url = redis_server.url.removesuffix("/0") + "/abc"
    proc = subprocess.run([*console_script("pd-decode"), "--model", str(tiny_llama), "--port", "0", "--grpc-port",
                           "0", "--kv-store", url], capture_output=True, text=True, timeout=HANG_S,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and lines == [
        f"pd-decode: error: KV store {url} unusable: redis URL path must be a database number "
        f"(redis://host:port/0), got '/abc' in {url!r}"], lines



def test_an_lmcache_store_url_whose_port_is_no_number_stops_the_node_with_one_line():
    """`--kv-store lm://host:abc`: one line and exit 1 at start-up (the LMCache branch of the store check),
    not a traceback; nothing loads before it."""
    url = "lm://127.0.0.1:abc"
    proc = subprocess.run([*console_script("pd-decode"), "--port", "0", "--grpc-port", "0", "--kv-store", url],
                          capture_output=True, text=True, timeout=HANG_S, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"pd-decode: error: KV store {url} unusable: bad port in '{url}'"), lines


# ------------------------------------------------------------------ --kv-transfer-config on pd-prefill / pd-decode

def _node(prog: str, *args: str, env: dict[str, str] | None = None) -> tuple[int, list[str]]:
    proc = subprocess.run([*console_script(prog), "--port", "0", "--grpc-port", "0", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
    return proc.returncode, proc.stderr.strip().splitlines()


def _usage_error(capsys, prog: str, *argv: str) -> list[str]:
    """A node command line that parsing refuses, run in this process (parsing fails before anything
    starts, and a subprocess would spend a second importing to show the same): exit 2, stderr's lines."""
    role = {"pd-prefill": PREFILL, "pd-decode": DECODE}[prog]
    with pytest.raises(SystemExit) as exit_info:
        node_main(role, ["--port", "0", "--grpc-port", "0", *argv])
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()


def _config(connector: str, role: str | None = None, **extra) -> str:
    config: dict = {"kv_connector": connector, "kv_connector_extra_config": extra}
    if role is not None:
        config["kv_role"] = role
    return json.dumps(config)


@pytest.mark.parametrize("prog,value,fragment", [
    ("pd-decode", _config("NixlConnector", "kv_consumer"),
     "unsupported kv_connector 'NixlConnector': pdserve has StoreConnector, SharedStorageConnector, "
     "LMCacheConnectorV1"),
    ("pd-prefill", "{kv_connector: StoreConnector}", "not valid JSON"),
    ("pd-prefill", '["StoreConnector"]', "expected a JSON object, got list"),
    ("pd-prefill", json.dumps({"kv_role": "kv_producer"}), "unsupported kv_connector None"),
    ("pd-prefill", json.dumps({"kv_connector": ["StoreConnector"]}), "unsupported kv_connector ['StoreConnector']"),
    ("pd-prefill", json.dumps({"kv_connector": "StoreConnector", "kv_ip": "10.0.0.1"}),
     "unsupported key 'kv_ip' (pdserve reads kv_connector, kv_role, kv_connector_extra_config)"),
    ("pd-decode", _config("StoreConnector", shared_storage_path="/tmp"),
     "unsupported kv_connector_extra_config key 'shared_storage_path' for StoreConnector"),
    ("pd-decode", _config("StoreConnector", "sender"), "kv_role must be kv_producer, kv_consumer or kv_both"),
    ("pd-decode", _config("StoreConnector", chunk_size="256"),
     "kv_connector_extra_config.chunk_size must be an integer >= 1, got '256'"),
    ("pd-decode", _config("StoreConnector", kv_load_timeout=0),
     "kv_connector_extra_config.kv_load_timeout must be a positive number of seconds, got 0"),
    ("pd-decode", _config("LMCacheConnectorV1", "kv_consumer"),
     "LMCacheConnectorV1 needs kv_connector_extra_config.kv_store (lm://host:port)"),
])
def test_bad_kv_transfer_config_is_one_line_exit_2(capsys, prog, value, fragment):
    lines = _usage_error(capsys, prog, "--kv-transfer-config", value)
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"{prog}: error: argument --kv-transfer-config: ") and fragment in lines[0], lines


@pytest.mark.parametrize("flag,value", [("--kv-role", "kv_both"), ("--chunk-size", "64"),
                                        ("--kv-store", "file:///tmp/other")])
def test_a_setting_given_in_the_json_and_as_a_flag_is_an_error(capsys, flag, value):
    lines = _usage_error(capsys, "pd-decode", "--kv-transfer-config",
                         _config("StoreConnector", "kv_consumer", kv_store="file:///tmp/kv", chunk_size=32), flag, value)
    assert len(lines) == 1, lines
    assert f"--kv-transfer-config: {flag} is given both in the JSON and as a flag; give it once" in lines[0], lines


@pytest.mark.parametrize("value,args,env,message", [
    # The URL picks the connector (connectors/factory.py): a name that disagrees with it is refused.
    (_config("StoreConnector", kv_store="lm://127.0.0.1:1"), [], {},
     "kv_connector StoreConnector takes a file://, redis:// or redis+cluster:// store (lm:// is "
     "LMCacheConnectorV1's), got 'lm://127.0.0.1:1'"),
    (_config("LMCacheConnectorV1", kv_store="file:///tmp/kv"), [], {},
     "kv_connector LMCacheConnectorV1 takes an lm://host:port store, got 'file:///tmp/kv'"),
    (_config("StoreConnector"), ["--lmcache-config", "/tmp/lmcache.yaml"], {},
     "kv_connector StoreConnector takes no LMCache config (that is LMCacheConnectorV1's)"),
    # LMCacheConnectorV1 reaches the LMCache path: its server is checked, or vLLM's LMCACHE_CONFIG_FILE read.
    (_config("LMCacheConnectorV1", "kv_consumer", kv_store="lm://127.0.0.1:{port}"), [], {},
     "LMCache server 127.0.0.1:{port} unreachable"),
    (_config("LMCacheConnectorV1", "kv_consumer"), [], {"LMCACHE_CONFIG_FILE": "/nonexistent/lmcache.yaml"},
     "cannot read LMCache config /nonexistent/lmcache.yaml"),
])
def test_kv_transfer_config_reaches_the_nodes_store_checks(value, args, env, message):
    port = str(free_port())
    rc, lines = _node("pd-decode", "--kv-transfer-config", value.replace("{port}", port), *args, env=env)
    assert rc == 1 and len(lines) == 1, lines
    assert lines[0].startswith("pd-decode: error: ") and message.replace("{port}", port) in lines[0], lines


def _log_line(server: ServerProcess, pattern: str, timeout_s: float = 10.0) -> re.Match:
    """The last line of the node's log matching `pattern`, waiting for it up to timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not (matches := list(re.finditer(pattern, server.log))):
        assert time.monotonic() < deadline, f"no line matching {pattern!r} in\n{server.log}"
        time.sleep(0.05)
    return matches[-1]


@pytest.mark.slow  # seconds: outside make test-quick
def test_kv_transfer_config_runs_a_prefill_and_a_decode_node(tiny_llama, tmp_path):
    """vLLM-style JSON alone configures both nodes: the prefill node (vLLM's SharedStorageConnector, its
    directory as a file store, chunks of 32) saves; the decode node (StoreConnector on the same store, and
    kv_both instead of its default kv_consumer) finds the prefix chunk by chunk (a prompt sharing its first
    70 tokens hits 64 of them, two whole chunks) and saves the rest of its prompt."""
    store = tmp_path / "kv"
    common = ["--model", str(tiny_llama), "--dtype", "float32", "--kv-cache-memory", "16MiB",
              "--max-model-len", "256", "--shutdown-timeout", "1"]
    prefill_config = _config("SharedStorageConnector", "kv_producer", shared_storage_path=str(store), chunk_size=32)
    decode_config = _config("StoreConnector", "kv_both", kv_store=store.as_uri(), chunk_size=32)
    first = list(range(5, 105))
    second = first[:70] + [7] * 30
    with ServerProcess(*common, "--grpc-port", "0", "--kv-transfer-config", prefill_config,
                       exe=console_script("pd-prefill")) as prefill, \
            ServerProcess(*common, "--grpc-port", "0", "--kv-transfer-config", decode_config,
                          exe=console_script("pd-decode")) as decode:
        status, _, body = prefill.request("POST", "/v1/completions", {"prompt": first, "max_tokens": 1},
                                          {"X-Request-Id": "first"})
        assert status == 200, body
        _log_line(prefill, r"Reqid: first, Stored 100 tokens \[0, 100\) of 100")
        assert any(store.rglob("*")), "the SharedStorageConnector directory holds no objects"

        status, _, body = decode.request("POST", "/v1/completions", {"prompt": second, "max_tokens": 4},
                                         {"X-Request-Id": "second"})
        assert status == 200, body
        _log_line(decode, r"Reqid: second, Total tokens 100, Local computed tokens: 0, KV hit tokens: 64, "
                          r"need to load: 64")
        _log_line(decode, r"Reqid: second, Stored 36 tokens \[64, 100\) of 100 \(skip_leading_tokens=64\)")
