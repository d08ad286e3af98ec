"""The served model's tokenizer, asked over HTTP: vLLM's /tokenize and /detokenize (pdserve's proxy, pd-serve
and its nodes serve them too).

pd-bench sizes its prompts in tokens. Without `--tokenizer MODEL_DIR` it asks the server, so a
"4000-token document" is 4000 tokens of the model being measured; the guess of 4 characters per token
it made before sent long-doc-qa prompts past the model's context (12 requests of 12 failed). A server
that has no /tokenize is an error that says to pass --tokenizer, never a silent guess.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


class ServerTokenizer:
    """`encode`/`decode` like a Hugging Face tokenizer (the two TextMaker uses), each one HTTP call."""

    def __init__(self, root_url: str, model: str, headers: dict[str, str] | None = None,
                 timeout_s: float = 60.0) -> None:
        self.root_url = root_url.rstrip("/")
        self.model = model
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        self.timeout_s = timeout_s
        self.max_model_len: int | None = None  # from the first /tokenize answer
        self.calls = 0

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        url = self.root_url + path
        request = urllib.request.Request(url, json.dumps(body).encode(), self.headers, method="POST")
        self.calls += 1
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            if e.code in (404, 405):
                raise ValueError(f"POST {url}: HTTP {e.code}: the server has no {path}; give --tokenizer MODEL_DIR "
                                 "(the served model's tokenizer) to size the prompts") from None
            raise ValueError(f"POST {url}: HTTP {e.code}: {e.read()[:300].decode(errors='replace')}") from None
        except (urllib.error.URLError, OSError) as e:
            raise ValueError(f"POST {url}: {getattr(e, 'reason', e)}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"POST {url}: not JSON ({e}); give --tokenizer MODEL_DIR") from None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        got = self._post("/tokenize", {"model": self.model, "prompt": text, "add_special_tokens": add_special_tokens})
        if not isinstance(got.get("tokens"), list):
            raise ValueError(f"POST {self.root_url}/tokenize: no token list in the answer; give --tokenizer MODEL_DIR")
        self.max_model_len = got.get("max_model_len", self.max_model_len)
        return [int(t) for t in got["tokens"]]

    def decode(self, token_ids: list[int]) -> str:
        got = self._post("/detokenize", {"model": self.model, "tokens": list(token_ids)})
        if not isinstance(got.get("prompt"), str):
            raise ValueError(f"POST {self.root_url}/detokenize: no prompt in the answer; give --tokenizer MODEL_DIR")
        return got["prompt"]
