"""A P/D cluster over seven "hosts" (Linux network namespaces, deploy/netns.py): the proxy, two
prefill nodes, two decode nodes, redis and LMCache's server, each with its own address; this test
process is the client, on the bridge. What loopback hides, exercised here: nodes bound to 0.0.0.0 or to
their own non-loopback address and reached at it, the stores reached across hosts, mutual TLS whose
certificates name the nodes' IP addresses, health checks across hosts, and a partition (a host's link
set down mid-stream: its packets vanish, no reset) that the proxy must route around without hanging.

Each pair uses one store (prefill0/decode0 redis, prefill1/decode1 LMCache), so both servers carry
KV across hosts; kv-aware routing sends each prompt's decode to a node whose store holds its KV.
Every answer is compared with Hugging Face transformers on the same weights.
"""
from __future__ import annotations

import json
import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from pdserve.deploy.netns import NetnsError, NetnsLab
from pdserve.deploy.processes import NODE_ARGS, Child, console_script, python_module, wait_for_port
from pdserve.proxy.decode_stream import Deadlines
from tests.helpers.cluster import wait_until
from tests.helpers.connector import hf_greedy
from tests.helpers.tls import make_pki
from tests.helpers.timing import HANG_S

pytestmark = pytest.mark.netns

HOSTS = ["proxy", "prefill0", "prefill1", "decode0", "decode1", "redis", "lmcache"]
KEY = "node-key-across-hosts"
STREAM_TOKENS = 200


@dataclass
class MultiHost:
    lab: NetnsLab
    children: dict[str, Child]
    url: str
    log_dir: Path

    def log(self, name: str) -> str:
        return self.children[name].out_path.read_text(errors="replace")


@pytest.fixture(scope="module")
def multihost(tiny_llama, tmp_path_factory):
    lab = NetnsLab(HOSTS)
    log_dir = tmp_path_factory.mktemp("multihost")
    children: dict[str, Child] = {}
    try:
        try:
            lab.create()
        except NetnsError as e:
            pytest.fail(str(e), pytrace=False)
        addr = lab.address
        pki = make_pki(log_dir / "pki", [addr(h) for h in HOSTS if h.startswith(("prefill", "decode"))])
        children["redis"] = Child("redis", lab.exec_argv("redis", [
            shutil.which("redis-server"), "--bind", addr("redis"), "--port", "6379", "--protected-mode", "no",
            "--save", "", "--appendonly", "no", "--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru"]), log_dir)
        children["lmcache"] = Child("lmcache", lab.exec_argv("lmcache", python_module(
            "lmcache.v1.server", addr("lmcache"), "65432", "cpu")), log_dir)
        for name in ("redis", "lmcache"):
            children[name].start()
        stores = {"0": f"redis://{addr('redis')}:6379/0", "1": f"lm://{addr('lmcache')}:65432"}
        assert wait_for_port(6379, 30, addr("redis")) and wait_for_port(65432, 60, addr("lmcache")), \
            children["lmcache"].tail()
        tls = ["--grpc-tls-cert", str(pki.node_cert), "--grpc-tls-key", str(pki.node_key), "--grpc-tls-ca",
               str(pki.ca), "--api-key", KEY]
        for host in HOSTS[1:5]:
            role, pair = host[:-1], host[-1]
            bind = "0.0.0.0" if role == "prefill" else addr(host)  # both kinds of non-loopback bind
            children[host] = Child(host, lab.exec_argv(host, [
                *console_script(f"pd-{role}"), "--model", str(tiny_llama), *NODE_ARGS, "--host", bind,
                "--port", "8100", "--grpc-port", "50051", "--kv-store", stores[pair],
                "--log-file", str(log_dir / f"{host}.log"), *tls]), log_dir)
            children[host].start()
        children["proxy"] = Child("proxy", lab.exec_argv("proxy", [
            *console_script("pd-proxy"), "--host", addr("proxy"), "--port", "8000", "--policy", "kv-aware",
            "--health-interval", "0.3", "--prefill", f"{addr('prefill0')}:50051,{addr('prefill1')}:50051",
            "--decode", f"{addr('decode0')}:50051,{addr('decode1')}:50051", "--grpc-tls-ca", str(pki.ca),
            "--grpc-tls-cert", str(pki.client_cert), "--grpc-tls-key", str(pki.client_key),
            "--node-api-key", KEY]), log_dir)
        children["proxy"].start()
        mh = MultiHost(lab, children, f"http://{addr('proxy')}:8000", log_dir)
        wait_until(lambda: _healthy(mh) == {h: True for h in HOSTS[1:5]} or _died(mh), "every node healthy", 240)
        assert not _died(mh), _died(mh)
        yield mh
    finally:
        for name, child in children.items():
            if name in ("redis", "lmcache"):
                child.kill()  # stores: nothing to drain
            else:
                child.terminate()
        for child in children.values():
            child.stop(timeout_s=10)
        lab.destroy()


def _died(mh: MultiHost) -> str | None:
    dead = next((c for c in mh.children.values() if c.proc is not None and c.proc.poll() is not None), None)
    return f"{dead.name} exited with {dead.proc.returncode}:\n{dead.tail()}" if dead else None


def _healthy(mh: MultiHost) -> dict[str, bool] | None:
    """Node host -> healthy, as the proxy's health checks across hosts see it."""
    try:
        s = httpx.get(mh.url + "/status", timeout=3).json()
    except (httpx.HTTPError, ValueError):
        return None
    by_address = {n["address"].split(":")[0]: n["healthy"] for n in s["prefill"] + s["decode"]}
    return {h: by_address.get(mh.lab.address(h), False) for h in HOSTS[1:5]}


def _prompt(seed: int, n: int = 150) -> list[int]:
    return [(seed * 31 + 7 * i) % 250 + 3 for i in range(n)]


def _complete(mh: MultiHost, prompt: list[int], rid: str, max_tokens: int = 4) -> list[int]:
    r = httpx.post(mh.url + "/v1/completions", headers={"X-Request-Id": rid}, timeout=90, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_nodes_bind_and_are_reached_across_hosts_with_exact_answers(multihost, tiny_llama):
    mh = multihost
    for host in HOSTS[1:5]:  # bound where asked, mutual TLS + key announced at start-up
        bind = "0.0.0.0" if host.startswith("prefill") else mh.lab.address(host)
        assert re.search(rf"gRPC {re.escape(bind)}:50051: mutual TLS .* and API key", mh.log(host)), mh.log(host)
    prompts = [_prompt(s) for s in range(4)]
    for i, prompt in enumerate(prompts):
        assert _complete(mh, prompt, f"warm{i}") == hf_greedy(tiny_llama, [prompt], 4)[0]
    # The KV went through a store on another host: decode nodes loaded prompts the prefill nodes computed.
    decode_logs = (mh.log_dir / "decode0.log").read_text() + (mh.log_dir / "decode1.log").read_text()
    hits = re.findall(r"Reqid: warm\d, Total tokens:? 150, .*KV hit tokens: ([1-9]\d*)", decode_logs)
    assert len(hits) >= 2, decode_logs[-3000:]


def _stream(mh: MultiHost, prompt: list[int], rid: str, out: dict) -> None:
    """Collect a streaming completion's token ids, finish reason and in-band error (runs in a thread)."""
    out.update(ids=[], finish=None, error=None)
    body = {"prompt": prompt, "max_tokens": STREAM_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    try:
        with httpx.stream("POST", mh.url + "/v1/completions", json=body, headers={"X-Request-Id": rid},
                          timeout=httpx.Timeout(90, connect=10)) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out["error"] = event["error"]
                    continue
                choice = event["choices"][0]
                out["ids"].extend(choice.get("token_ids") or [])
                out["finish"] = choice.get("finish_reason") or out["finish"]
    except httpx.HTTPError as e:
        out["error"] = repr(e)
    out["done_at"] = time.monotonic()


def test_partition_mid_stream_is_routed_around_without_hanging(multihost, tiny_llama):
    mh = multihost
    prompt = _prompt(10)
    expected = hf_greedy(tiny_llama, [prompt], STREAM_TOKENS)[0]
    out: dict = {}
    reader = threading.Thread(target=_stream, args=(mh, prompt, "cut", out), daemon=True)
    reader.start()
    line = wait_until(lambda: re.search(r"Reqid: cut, decoding on ([\d.]+):", mh.log("proxy")),
                      "the stream's decode node", 60)
    wait_until(lambda: out.get("ids") or out.get("done_at"), "the stream's first tokens", 60)
    decode = next(h for h in ("decode0", "decode1") if mh.lab.address(h) == line.group(1))
    prefill = "prefill0" if decode == "decode0" else "prefill1"
    cut_at = time.monotonic()
    mh.lab.set_link(decode, up=False)
    mh.lab.set_link(prefill, up=False)
    try:
        # New requests go around the partitioned hosts, exact, none hangs (a call already on its way to
        # them fails within the keepalive deadline and is retried on the other node).
        results: dict[int, list[int]] = {}
        prompts = {i: _prompt(20 + i) for i in range(3)}
        workers = [threading.Thread(target=lambda i=i: results.__setitem__(i, _complete(mh, prompts[i], f"after{i}")))
                   for i in prompts]
        for w in workers:
            w.start()
        for w in workers:
            w.join(90)
        assert not any(w.is_alive() for w in workers), "a request hung during the partition"
        for i, prompt in prompts.items():
            assert results[i] == hf_greedy(tiny_llama, [prompt], 4)[0]
        assert wait_until(lambda: (h := _healthy(mh)) and not h[decode] and not h[prefill] and h, "the proxy "
                          "seeing the partition") == {**{h: True for h in HOSTS[1:5]}, decode: False, prefill: False}
        # The stream that was on the partitioned decode node goes silent; the proxy resumes it on the other
        # decode node once its stall deadline passes (5 s by default): one uninterrupted stream, every token
        # exact. The token deadline (60 s) would end the silence too: the stream must be done before it,
        # however slow the machine.
        token_s = Deadlines().token_s
        reader.join(max(0.0, cut_at + token_s - time.monotonic()) + HANG_S)
        assert not reader.is_alive(), f"the stream hung after the partition: {len(out['ids'])} tokens so far"
        assert out["done_at"] - cut_at < token_s, "the stream was resumed only at the token deadline"
        assert (out["ids"], out["finish"], out["error"]) == (expected, "length", None)
        assert re.search(r"Reqid: cut, resuming on [\d.]+:\d+ after \d+ tokens", mh.log("proxy"))
    finally:
        mh.lab.set_link(decode, up=True)
        mh.lab.set_link(prefill, up=True)
    # Healed: the health checks bring both back, and they serve again.
    wait_until(lambda: _healthy(mh) == {h: True for h in HOSTS[1:5]}, "the nodes back in rotation", 60)
    prompt = _prompt(30)
    assert _complete(mh, prompt, "healed") == hf_greedy(tiny_llama, [prompt], 4)[0]
