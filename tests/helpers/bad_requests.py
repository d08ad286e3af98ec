"""Bad requests and the error each must get (body, the `param` its 400 names, its `code`), for a server whose
--max-model-len is MAX_MODEL_LEN: pd-serve's own checks (tests/serving/test_serve_errors.py) and the same
through pd-proxy (tests/cluster/test_stores.py)."""
from __future__ import annotations

from tests.helpers.prompts import random_prompt

MAX_MODEL_LEN = 1024
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
