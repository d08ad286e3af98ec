"""Hostile clients at every HTTP edge: pd-proxy, pd-serve and both node HTTP ports.

Over raw sockets, each bad request gets an OpenAI-shaped 4xx within its deadline (corrupt gzip and
deflate bodies, unsupported encodings, malformed request lines, headers and chunking, oversized
headers and bodies, `Expect: 100-continue` over the limit answered 413 before the body); slow
headers and bodies get 408 at their deadline, silent and idle connections are closed, and a
slowloris connection is cut at the header deadline while other clients are served. Also: with a
prefill node frozen under 24 prefills in flight, the proxy's log names the cause once per line
(no `left rotation while prefilling (left rotation while prefilling (...))`).
"""
from __future__ import annotations

import gzip
import json
import os
import signal
import socket
import subprocess
import threading
import time
import zlib
from dataclasses import dataclass

import httpx
import pytest

from pdserve.deploy.processes import NODE_ARGS, console_script
from pdserve.deploy.server_process import ServerProcess
from pdserve.serving.limits import HttpTimeouts
from tests.helpers.cluster import start_cluster, wait_until
from tests.helpers.timing import HANG_S

HEADER_S, BODY_S, KEEP_ALIVE_S = 1.0, 1.0, 2.0
DEADLINES = ["--timeout-request-header", str(HEADER_S), "--timeout-request-body", str(BODY_S),
             "--timeout-keep-alive", str(KEEP_ALIVE_S)]
# What each deadline would be without the flags above (10, 60 and 75 s). A deadline fires at its flag's
# value, never before (the test's clock starts before the server's), and before its default: a loaded
# machine may run the timer late by seconds, but not by the difference, and a flag that did not take
# effect is told apart. A deadline that never fires ends at the socket's HANG_S.
DEFAULTS = HttpTimeouts()
MAX_BODY = 8 << 20


@pytest.fixture(scope="module")
def serve(tiny_llama):
    with ServerProcess("--model", str(tiny_llama), "--served-model-name", "tiny", "--kv-cache-memory", "16MiB",
                       *DEADLINES) as srv:
        yield srv


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory):
    c = start_cluster(tiny_llama, tmp_path_factory.mktemp("edges"), node_args=[*NODE_ARGS, *DEADLINES],
                      proxy_args=DEADLINES)
    yield c
    c.stop()


@pytest.fixture(params=["proxy", "pd-serve", "prefill-http", "decode-http"])
def port(request) -> int:
    """The HTTP port of each kind of edge."""
    if request.param == "pd-serve":
        return int(request.getfixturevalue("serve").url.rsplit(":", 1)[1])
    c = request.getfixturevalue("cluster")
    return {"proxy": c.proxy_port, "prefill-http": c.prefill[0].http_port,
            "decode-http": c.decode[0].http_port}[request.param]


# ---------------------------------------------------------------- a raw HTTP/1.1 client

@dataclass
class Answer:
    status: int  # 0: the connection closed without an answer
    headers: dict[str, str]
    body: bytes
    interim: list[int]  # 1xx statuses before the answer
    seconds: float  # from the first byte sent (or the connect) to the answer
    closed: bool  # the server closed the connection after it


def _read_answer(sock: socket.socket, started: float, timeout_s: float) -> Answer:
    sock.settimeout(timeout_s)
    raw, interim = b"", []
    while True:
        while b"\r\n\r\n" not in raw:
            chunk = sock.recv(65536)
            if not chunk:
                return Answer(0, {}, raw, interim, time.monotonic() - started, True)
            raw += chunk
        head, _, raw = raw.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        if 100 <= status < 200:
            interim.append(status)
            continue
        seconds = time.monotonic() - started
        length = int(headers.get("content-length", "0"))
        while len(raw) < length:
            chunk = sock.recv(65536)
            if not chunk:
                break
            raw += chunk
        try:
            sock.settimeout(0.5)
            closed = sock.recv(1) == b""
        except (socket.timeout, TimeoutError):
            closed = False
        except ConnectionResetError:
            closed = True
        return Answer(status, headers, raw[:length], interim, seconds, closed)


def exchange(port: int, *parts: bytes, pause_s: float = 0.0, timeout_s: float = HANG_S) -> Answer:
    """Send `parts` (pausing `pause_s` between them) on a new connection and read the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        started = time.monotonic()
        for i, part in enumerate(parts):
            if i and pause_s:
                time.sleep(pause_s)
            sock.sendall(part)
        return _read_answer(sock, started, timeout_s)


def post(body: bytes, *headers: str, length: int | str | None = None) -> bytes:
    """A completions POST with `body` (Content-Length `length`, default the body's; "" for none)."""
    length = len(body) if length is None else length
    head = ["POST /v1/completions HTTP/1.1", "Host: edge", "Content-Type: application/json",
            *([f"Content-Length: {length}"] if length != "" else []), *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def assert_openai_error(answer: Answer, status: int, code: str | None = None) -> dict:
    assert answer.status == status, answer
    assert answer.headers["content-type"].startswith("application/json") and answer.headers.get("x-request-id")
    err = json.loads(answer.body)
    assert list(err) == ["error"] and set(err["error"]) == {"message", "type", "param", "code"}, err
    assert err["error"]["type"] == "invalid_request_error" and "Traceback" not in err["error"]["message"]
    if code is not None:
        assert err["error"]["code"] == code, err
    return err["error"]


REQUEST = json.dumps({"prompt": [5, 6, 7], "max_tokens": 2}).encode()
GZIP_GARBAGE = b"\x1f\x8b\x08\x00garbage, not a gzip stream"


# ---------------------------------------------------------------- bad bytes: a 4xx at once

BAD_REQUESTS = {
    "corrupt gzip": (post(GZIP_GARBAGE, "Content-Encoding: gzip"), 400, "invalid_request_body"),
    "corrupt deflate": (post(b"not deflate at all", "Content-Encoding: deflate"), 400, "invalid_request_body"),
    "truncated gzip": (post(zlib.compress(REQUEST)[:-6], "Content-Encoding: deflate"), 400, None),
    "unsupported encoding": (post(REQUEST, "Content-Encoding: br"), 400, "invalid_http_request"),
    "garbage request line": (b"GARBAGE\r\n\r\n", 400, "invalid_http_request"),
    "bad header name": (post(REQUEST, "Bad Header: x"), 400, "invalid_http_request"),
    "header over 32 KiB": (post(REQUEST, "X-Big: " + "a" * (40 << 10)), 400, "invalid_http_request"),
    "Content-Length and chunked": (post(b"0\r\n\r\n", "Transfer-Encoding: chunked"), 400, "invalid_http_request"),
    "Content-Length not a number": (post(REQUEST, length="12x"), 400, "invalid_http_request"),
    "broken chunk size": (post(b"zz\r\nabc\r\n0\r\n\r\n", "Transfer-Encoding: chunked", length=""), 400,
                          "invalid_http_request"),
    "9 MiB announced": (post(b"", length=9 << 20), 413, "request_too_large"),
    "gzip of 9 MiB": (post(gzip.compress(b" " * (9 << 20)), "Content-Encoding: gzip"), 413, "request_too_large"),
    "Expect: 100-continue, 9 MiB": (post(b"", "Expect: 100-continue", length=9 << 20), 413, "request_too_large"),
    "Expect: something else": (post(REQUEST, "Expect: magic"), 417, "expectation_failed"),
}


@pytest.mark.parametrize("what", BAD_REQUESTS)
def test_bad_bytes_get_an_openai_4xx_at_once(port, what):
    data, status, code = BAD_REQUESTS[what]
    answer = exchange(port, data)
    # At once: a server that waited for more (a body never sent, the rest of a line) would answer its
    # deadline's 408, not this status; one that waited for nothing at all would not answer before HANG_S.
    assert_openai_error(answer, status, code)
    assert answer.interim == []
    if what == "Expect: 100-continue, 9 MiB":
        assert answer.closed  # refused before the body, which then never comes: the connection ends


def test_broken_chunk_after_a_good_one_is_400_not_a_wait(port):
    head = post(b"", "Transfer-Encoding: chunked", length="")
    answer = exchange(port, head + b"5\r\n{\"pro\r\n", b"zz\r\nabc\r\n0\r\n\r\n", pause_s=0.2)
    assert_openai_error(answer, 400, "invalid_request_body")  # not the body deadline's 408: it did not wait
    assert answer.closed


@pytest.mark.slow  # seconds: outside make test-quick
def test_expect_100_continue_within_the_limit_gets_continue_then_the_answer(port):
    with socket.create_connection(("127.0.0.1", port), timeout=HANG_S) as sock:
        sock.sendall(post(b"", "Expect: 100-continue", length=len(b"{not json")))
        assert sock.recv(64).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")  # before any byte of the body
        sock.sendall(b"{not json")
        answer = _read_answer(sock, time.monotonic(), HANG_S)
    assert_openai_error(answer, 400)


# ---------------------------------------------------------------- slow clients: 408 at the deadline

TIMER_EARLY_S = 0.01  # asyncio runs a timer up to its clock's resolution early


def fired_at(seconds: float, deadline_s: float, default_s: float) -> bool:
    """`seconds`, counted from before the server could start its timer, is the flag's deadline (maybe
    late): not before it, and before the default the flag replaced."""
    return deadline_s - TIMER_EARLY_S <= seconds < default_s


@pytest.mark.slow  # seconds: outside make test-quick
def test_half_sent_headers_get_408_at_the_header_deadline(port):
    answer = exchange(port, b"POST /v1/completions HTTP/1.1\r\nHost: edge\r\n")
    assert_openai_error(answer, 408, "request_timeout")
    assert fired_at(answer.seconds, HEADER_S, DEFAULTS.header_s) and answer.closed, answer


@pytest.mark.slow  # seconds: outside make test-quick
def test_half_sent_body_gets_408_at_the_body_deadline(port):
    answer = exchange(port, post(REQUEST[:5], length=len(REQUEST)))
    assert_openai_error(answer, 408, "request_timeout")
    assert fired_at(answer.seconds, BODY_S, DEFAULTS.body_s) and answer.closed, answer


@pytest.mark.slow  # seconds: outside make test-quick
def test_silent_and_idle_connections_are_closed(port):
    silent = exchange(port)  # connects, sends nothing: closed at the header deadline, no answer
    assert silent.status == 0 and silent.body == b"" and fired_at(silent.seconds, HEADER_S, DEFAULTS.header_s), silent
    with socket.create_connection(("127.0.0.1", port), timeout=HANG_S) as sock:
        for _ in range(2):  # keep-alive works ...
            asked = time.monotonic()  # (the server's idle timer starts after its answer, so after this)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: edge\r\n\r\n")
            answer = _read_answer(sock, asked, HANG_S)
            assert answer.status == 200 and not answer.closed
        sock.settimeout(DEFAULTS.keep_alive_s + HANG_S)
        assert sock.recv(1) == b""  # ... until the connection idles for the keep-alive timeout
        assert fired_at(time.monotonic() - asked, KEEP_ALIVE_S, DEFAULTS.keep_alive_s)


def test_slowloris_is_cut_at_the_header_deadline_while_others_are_served(cluster):
    """A client trickling header bytes (each well within any idle limit) is closed at the header
    deadline, counted from the accept; meanwhile ordinary clients get their completions."""
    result: list[tuple[Answer, float]] = []
    # Header lines 0.1 s apart for as long as the default header deadline: a deadline counted from each
    # byte (or not at all) lets all of them through, one counted from the accept cuts the trickle short.
    lines = int(DEFAULTS.header_s / 0.1)
    parts = [b"POST /v1/completions HTTP/1.1\r\n"] + [b"X-Slow-%d: y\r\n" % i for i in range(lines)]

    def slowloris() -> None:
        started = time.monotonic()
        try:
            answer = exchange(cluster.proxy_port, *parts, pause_s=0.1)
        except (BrokenPipeError, ConnectionResetError):  # cut while sending: that is the point
            answer = Answer(0, {}, b"", [], 0.0, True)
        result.append((answer, time.monotonic() - started))

    thread = threading.Thread(target=slowloris)
    thread.start()
    served = 0
    with httpx.Client(base_url=cluster.url, timeout=30) as client:
        while thread.is_alive() or served < 3:
            r = client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2})
            assert r.status_code == 200, r.text
            served += 1
    thread.join()
    ((answer, seconds),) = result
    assert fired_at(seconds, HEADER_S, DEFAULTS.header_s), seconds  # its lines alone take DEFAULTS.header_s
    assert answer.closed and answer.status in (0, 408), answer  # 408 when it was reading, else cut off
    if answer.status:
        assert_openai_error(answer, 408, "request_timeout")
    assert served >= 3


# ---------------------------------------------------------------- error text that never nests

def test_a_frozen_prefill_node_under_24_prefills_logs_one_cause_per_line(cluster):
    """SIGSTOP the prefill node, then send 24 requests: they wait on it until its health probe fails,
    then the decode node prefills each locally. Every request notices the node left rotation; none
    of their log lines (nor /status) quotes another's notice."""
    prefill = cluster.prefill[0]
    os.kill(prefill.proc.pid, signal.SIGSTOP)
    try:
        with httpx.Client(base_url=cluster.url, timeout=120) as client:
            threads, statuses = [], []

            def one(k: int) -> None:
                r = client.post("/v1/completions", json={"prompt": [5 + k, 6, 7, 8], "max_tokens": 2})
                statuses.append(r.status_code)

            for k in range(24):
                threads.append(threading.Thread(target=one, args=(k,)))
                threads[-1].start()
            for t in threads:
                t.join()
        assert statuses == [200] * 24
        status = httpx.get(cluster.url + "/status", timeout=10).json()["prefill"][0]
        assert not status["healthy"] and status["last_error"].count("(") <= 1, status
    finally:
        os.kill(prefill.proc.pid, signal.SIGCONT)
    log = cluster.proxy.out_path.read_text()
    noticed = [line for line in log.splitlines() if "left rotation while prefilling" in line]
    assert len(noticed) >= 20, log[-3000:]  # the scenario happened: the requests waited on the frozen node
    for line in noticed:
        assert line.count("left rotation") == 1, line
    wait_until(lambda: all(n["healthy"] for n in httpx.get(cluster.url + "/status", timeout=10).json()["prefill"]),
               "the prefill node back in rotation", 30)


# ---------------------------------------------------------------- the flags

@pytest.mark.parametrize("program,args", [
    ("pd-serve", ["--timeout-request-header", "0"]),
    ("pd-decode", ["--timeout-request-body", "nan"]),
    ("pd-proxy", ["--decode", "127.0.0.1:1", "--timeout-keep-alive", "-1"]),
])
@pytest.mark.slow  # seconds: outside make test-quick
def test_a_bad_deadline_flag_is_one_line_exit_2(program, args):
    proc = subprocess.run([*console_script(program), *args], capture_output=True, text=True, timeout=60,
                          env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"{program}: error: argument {args[-2]}: expected a positive number of seconds")
