"""Every bad input gets its status and an OpenAI-shaped error; a full waiting queue and a shutting-down
server answer 503; SIGINT drains and exits cleanly. One real pd-serve with small limits."""
from __future__ import annotations

import json
import signal
import time

import pytest

from pdserve.deploy.server_process import ServerProcess
from tests.helpers.serve import open_stream, send_request, sse_events
from tests.engine.test_generate import random_prompt
from tests.helpers.timing import HANG_S

MAX_MODEL_LEN = 1024


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


LONG = random_prompt(MAX_MODEL_LEN + 1, seed=9)
BAD_COMPLETIONS = [
    (b"{not json", None, "invalid_json"),
    (b"[1, 2]", None, None),
    ({}, "prompt", "missing_required_parameter"),
    ({"prompt": ""}, "prompt", None),
    ({"prompt": []}, "prompt", None),
    ({"prompt": ["a", 5]}, "prompt", None),
    ({"prompt": [5, 100000]}, "prompt", None),
    ({"prompt": [5, -1]}, "prompt", None),
    ({"prompt": "x", "max_tokens": "10"}, "max_tokens", None),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", None),
    ({"prompt": "x", "temperature": -0.5}, "temperature", None),
    ({"prompt": "x", "temperature": True}, "temperature", None),
    ({"prompt": "x", "top_p": 0}, "top_p", None),
    ({"prompt": "x", "top_k": -2}, "top_k", None),
    ({"prompt": "x", "seed": "7"}, "seed", None),
    ({"prompt": "x", "stop": [1]}, "stop", None),
    ({"prompt": "x", "stream": "yes"}, "stream", None),
    ({"prompt": "x", "n": 0}, "n", None),
    ({"prompt": "x", "logprobs": 50}, "logprobs", None),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty", None),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias", None),
    ({"prompt": "x", "logit_bias": {"100000": 1}}, "logit_bias", None),
    ({"prompt": "x", "suffix": "y"}, "suffix", "unsupported_parameter"),
    ({"prompt": "x", "frobnicate": 1}, "frobnicate", "unsupported_parameter"),
    ({"prompt": "x", "guided_json": {"type": "nope"}}, "guided_json", None),
    ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs", None),
    ({"prompt": "x", "stream_options": 3}, "stream_options", None),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", None),  # without stream
    ({"prompt": "x", "stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options",
     "unsupported_parameter"),
    ({"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": "yes"}}, "stream_options", None),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": True, "usage_every": 2}}, "stream_options",
     "unsupported_parameter"),
    ({"prompt": LONG}, "prompt", "context_length_exceeded"),
    ({"prompt": LONG[:1000], "max_tokens": 100}, "max_tokens", "context_length_exceeded"),
]
BAD_CHATS = [
    ({}, "messages", "missing_required_parameter"),
    ({"messages": []}, "messages", None),
    ({"messages": [{"role": 5, "content": "hi"}]}, "messages", None),
    ({"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True}, "continue_final_message",
     None),
    ({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": ["x"]}, "chat_template_kwargs", None),
    ({"messages": [{"role": "user", "content": "hi"}], "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", None),
    ({"messages": [{"role": "user", "content": "hi"}], "bad_words": [""]}, "bad_words", None),
    ({"messages": [{"role": "user", "content": "hi"}], "priority": "high"}, "priority", None),
    ({"messages": [{"role": "user", "content": 5}]}, "messages", None),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -1}, "max_completion_tokens",
     None),
    ({"messages": [{"role": "user", "content": "x" * 2000}]}, "messages", "context_length_exceeded"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs", None),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs", None),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools",
     "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema"}}, "response_format",
     None),
]


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
