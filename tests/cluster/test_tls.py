"""TLS and the shared key between pd-proxy and the nodes: mutual TLS with certificates this test makes,
a node --api-key the proxy sends; clients without the key, without a certificate, with another CA's
certificate or in plaintext are refused, and the proxy's own answers stay exact."""
from __future__ import annotations

import subprocess

import grpc
import httpx
import pytest

from pdserve.deploy.processes import (NODE_ARGS, Child, ClusterSpec, LocalCluster, console_script, free_port,
                                      python_module)
from pdserve.protos import pdserve_pb2 as pb
from pdserve.protos import pdserve_pb2_grpc as pb_grpc
from tests.helpers.cluster import status, wait_until
from tests.helpers.connector import hf_greedy
from tests.helpers.tls import Pki, make_pki

pytestmark = pytest.mark.slow

KEY = "s3cret-node-key"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"), ["127.0.0.1", "localhost"])


@pytest.fixture(scope="module")
def tls_cluster(tiny_llama, pki, tmp_path_factory):
    node_tls = ["--grpc-tls-cert", str(pki.node_cert), "--grpc-tls-key", str(pki.node_key),
                "--grpc-tls-ca", str(pki.ca), "--api-key", KEY]
    proxy_tls = ["--grpc-tls-ca", str(pki.ca), "--grpc-tls-cert", str(pki.client_cert),
                 "--grpc-tls-key", str(pki.client_key), "--node-api-key", KEY, "--health-interval", "0.3"]
    cluster = LocalCluster(ClusterSpec(model=str(tiny_llama), log_dir=tmp_path_factory.mktemp("tls-logs"),
                                       node_args=[*NODE_ARGS, *node_tls], proxy_args=proxy_tls))
    cluster.start(timeout_s=240)
    yield cluster
    cluster.stop()


def _health(address: str, credentials: grpc.ChannelCredentials | None, key: str | None) -> grpc.StatusCode:
    """The status of one Health call from this test process (OK when the node answered)."""
    channel = grpc.insecure_channel(address) if credentials is None else grpc.secure_channel(address, credentials)
    with channel:
        try:
            pb_grpc.PDNodeStub(channel).Health(pb.HealthRequest(), timeout=10,
                                               metadata=[("authorization", f"Bearer {key}")] if key else None)
            return grpc.StatusCode.OK
        except grpc.RpcError as e:
            return e.code()


def test_proxy_serves_exact_answers_over_mutual_tls_with_the_key(tls_cluster, tiny_llama):
    prompt = [(5 * i) % 200 + 3 for i in range(150)]
    r = httpx.post(tls_cluster.url + "/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == hf_greedy(tiny_llama, [prompt], 4)[0]
    for node in tls_cluster.prefill + tls_cluster.decode:
        line = next(ln for ln in node.out_path.read_text().splitlines() if f"gRPC 127.0.0.1:{node.grpc_port}" in ln)
        assert "mutual TLS" in line and "API key" in line, line


def test_nodes_refuse_clients_without_key_certificate_or_tls(tls_cluster, pki):
    address = tls_cluster.decode[0].grpc_address
    ca, cert, key, rogue_cert, rogue_key = pki.read(pki.ca, pki.client_cert, pki.client_key, pki.rogue_cert,
                                                    pki.rogue_key)
    mutual = grpc.ssl_channel_credentials(ca, key, cert)
    assert _health(address, mutual, KEY) == grpc.StatusCode.OK
    assert _health(address, mutual, None) == grpc.StatusCode.UNAUTHENTICATED  # right certificate, no key
    assert _health(address, mutual, "wrong") == grpc.StatusCode.UNAUTHENTICATED
    assert _health(address, grpc.ssl_channel_credentials(ca), KEY) == grpc.StatusCode.UNAVAILABLE  # no client cert
    assert _health(address, grpc.ssl_channel_credentials(ca, rogue_key, rogue_cert), KEY) == \
        grpc.StatusCode.UNAVAILABLE  # a certificate from another CA
    assert _health(address, None, KEY) == grpc.StatusCode.UNAVAILABLE  # plaintext
    # The node's HTTP API takes the same key; probes and scrapers stay open.
    http = f"http://127.0.0.1:{tls_cluster.decode[0].http_port}"
    r = httpx.get(http + "/v1/models", timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(http + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).status_code == 200
    assert httpx.get(http + "/health", timeout=10).status_code == 200


def test_a_proxy_with_the_wrong_key_sees_no_healthy_node(tls_cluster, pki):
    port = free_port()
    proxy = Child("proxy-wrong-key", python_module(
        "pdserve.proxy", "--port", str(port), "--health-interval", "0.3", "--grpc-tls-ca", str(pki.ca),
        "--grpc-tls-cert", str(pki.client_cert), "--grpc-tls-key", str(pki.client_key), "--node-api-key", "wrong",
        "--prefill", tls_cluster.prefill[0].grpc_address, "--decode", tls_cluster.decode[0].grpc_address),
        tls_cluster.spec.log_dir)
    proxy.start()
    try:
        url = f"http://127.0.0.1:{port}"
        errors = wait_until(lambda: _errors(url), "the wrong-key proxy's first health checks", 60)
        assert all(e and e.startswith("UNAUTHENTICATED") for e in errors), errors
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503, r.text
    finally:
        proxy.stop()


def _errors(url: str) -> list[str] | None:
    try:
        s = status(url)
    except (httpx.HTTPError, ValueError):
        return None
    errors = [n["last_error"] for n in s["prefill"] + s["decode"]]
    return errors if all(errors) else None


def test_bad_tls_options_fail_at_start_with_one_line(pki, tmp_path):
    cases = [(["pd-proxy", "--decode", "127.0.0.1:1", "--grpc-tls-cert", str(pki.client_cert), "--grpc-tls-key",
               str(pki.client_key)], "give --grpc-tls-ca too"),
             (["pd-decode", "--grpc-tls-cert", str(pki.node_cert)], "--grpc-tls-cert and --grpc-tls-key go together"),
             (["pd-decode", "--grpc-tls-ca", str(pki.ca)], "needs --grpc-tls-cert"),
             (["pd-prefill", "--grpc-tls-cert", str(tmp_path / "missing.crt"), "--grpc-tls-key", str(pki.node_key)],
              "cannot read")]
    for argv, message in cases:
        proc = subprocess.run([*console_script(argv[0]), *argv[1:]], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1 and message in proc.stderr, (argv, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
