"""Requests under a LoRA adapter against any OpenAI endpoint (pd-proxy, a node): greedy token ids and the
prompt's cached-token count, streamed or not."""
from __future__ import annotations

import json

import httpx


def completion_ids(url: str, model: str, prompt: list[int], max_tokens: int,
                   request_id: str | None = None) -> tuple[list[int], int]:
    """(greedy token ids, cached prompt tokens) of one completion under `model` (an adapter or the base)."""
    r = httpx.post(url + "/v1/completions", timeout=120, headers={"X-Request-Id": request_id} if request_id else {},
                   json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                         "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["token_ids"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def stream_token_ids(url: str, model: str, prompt: list[int], max_tokens: int) -> list[int]:
    """The token ids of one greedy streamed completion (ignore_eos: exactly max_tokens of them)."""
    ids: list[int] = []
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "return_token_ids": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[len("data: "):])["choices"]:
                    ids += choice.get("token_ids") or []
    return ids
