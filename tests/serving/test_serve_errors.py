"""Every bad input gets its status and an OpenAI-shaped error; a full waiting queue and a shutting-down
server answer 503; SIGINT drains and exits cleanly. One real pd-serve with small limits."""
from __future__ import annotations

import json
import signal
import time

import pytest

from pdserve.deploy.server_process import ServerProcess
from tests.helpers.serve import open_stream, send_request, sse_events
from tests.helpers.bad_requests import BAD_CHATS, BAD_COMPLETIONS, MAX_MODEL_LEN
from tests.helpers.timing import HANG_S



@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = ServerProcess("--model", str(tiny_llama), "--served-model-name", "tiny", "--max-model-len",
                        str(MAX_MODEL_LEN), "--kv-cache-memory", "16MiB", "--max-num-seqs", "1",
                        "--max-waiting-requests", "1", "--shutdown-timeout", "0.5").start()
    yield srv
    srv.stop()


def _assert_error(status_body, status: int, param=None, code=None) -> dict:
    got_status, headers, body = status_body
    assert got_status == status, body
    assert headers["Content-Type"].startswith("application/json") and headers.get("X-Request-Id")
    err = json.loads(body)
    assert list(err) == ["error"] and set(err["error"]) == {"message", "type", "param", "code"}
    assert err["error"]["message"] and "Traceback" not in err["error"]["message"]
    assert (err["error"]["param"], err["error"]["code"]) == (param, code)
    return err["error"]


@pytest.mark.parametrize("body,param,code", BAD_COMPLETIONS)
def test_bad_completion_request_is_400(server, body, param, code):
    _assert_error(server.request("POST", "/v1/completions", body), 400, param, code)


@pytest.mark.parametrize("body,param,code", BAD_CHATS)
def test_bad_chat_request_is_400(server, body, param, code):
    _assert_error(server.request("POST", "/v1/chat/completions", body), 400, param, code)


def test_unknown_model_is_404(server):
    for path, body in (("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        err = _assert_error(server.request("POST", path, {**body, "model": "gpt-9"}), 404, "model",
                            "model_not_found")
        # vLLM's type and message, then the names that would have worked
        assert err["type"] == "NotFoundError"
        assert err["message"] == "The model `gpt-9` does not exist. Served model names: tiny"
    assert server.request("POST", "/v1/completions", {"prompt": "x", "model": "tiny", "max_tokens": 1})[0] == 200


def test_bad_request_id_unknown_route_and_method(server):
    _assert_error(server.request("POST", "/v1/completions", {"prompt": "x"}, headers={"X-Request-Id": "a" * 200}),
                  400)
    _assert_error(server.request("GET", "/v1/nothing"), 404, None, "404")
    _assert_error(server.request("GET", "/v1/completions"), 405, None, "405")


def test_full_waiting_queue_is_503(server):
    # max_num_seqs 1: A runs; B is accepted and waits (the whole queue, limit 1); C is turned away.
    a = open_stream(server, {"prompt": "a", "max_tokens": 1000, "ignore_eos": True, "stream": True}, "qa")
    assert a.readline().startswith(b"data: {")
    b_conn = send_request(server, {"prompt": "b", "max_tokens": 4, "stream": True}, "qb")
    server.wait_for(lambda s: s["num_unstarted"] == 1, "B to be queued")
    err = _assert_error(server.request("POST", "/v1/completions", {"prompt": "c", "max_tokens": 4},
                                       headers={"X-Request-Id": "qc"}), 503, None, "queue_full")
    assert "retry" in err["message"]
    a.close()  # A's client leaves; B gets the batch slot and completes
    b = b_conn.getresponse()
    events = sse_events(b.read().splitlines())
    assert b.status == 200 and events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    metrics = server.request("GET", "/metrics")[2].decode()
    assert 'outcome="rejected"} 1.0' in metrics


def test_sigint_drains_then_exits_cleanly(server):
    """Runs last: new requests get 503 while the in-flight stream gets its grace period, then ends."""
    d = open_stream(server, {"prompt": "d", "max_tokens": 1000, "ignore_eos": True, "stream": True,
                             "stream_options": {"include_usage": True}}, "qd")
    before: list = []  # up to the first chunk with text: the drain may then end the stream at once
    while not any(e["choices"] and e["choices"][0]["text"] for e in before):
        line = d.readline()
        assert line, "the stream ended before its first text"
        before += sse_events([line])
    server.proc.send_signal(signal.SIGINT)
    _wait_health_503(server)
    _assert_error(server.request("POST", "/v1/completions", {"prompt": "e"}), 503, None, "shutting_down")
    events = before + sse_events(d.read().splitlines())
    assert events[-1] == "[DONE]" and events[-3]["choices"][0]["finish_reason"] == "abort"
    # the usage of a stream cut short counts the tokens sent (running outputs carry only their deltas)
    sent_chunks = sum(1 for e in events[:-2] if e["choices"] and e["choices"][0]["text"])
    assert events[-2]["usage"]["completion_tokens"] >= sent_chunks >= 1
    assert server.proc.wait(30) == 0
    assert "pd-serve stopped" in server.log and "Traceback" not in server.log


def _wait_health_503(server) -> None:
    deadline = time.monotonic() + HANG_S
    while server.request("GET", "/health")[0] != 503:
        assert time.monotonic() < deadline, "server never reported shutting down"
        time.sleep(0.02)
    _assert_error(server.request("GET", "/health"), 503, None, "shutting_down")
