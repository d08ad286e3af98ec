"""What `make serve` serves: SmolLM2-135M-Instruct in bf16. P/D (proxy -> prefill node -> KV store -> decode node),
over the file store and over redis, answers greedy chats token for token as `pd-serve` does on the same
weights: the prefill node samples the first token from the prompt's last position exactly as monolithic
prefill does, and the decode node continues from it over the loaded KV (docs/architecture.md, "The first
token"), so no bf16 rounding of a differently-shaped computation can part the two."""
from __future__ import annotations

import pytest

from pdserve.deploy.processes import CHUNK_SIZE
from pdserve.deploy.server_process import ServerProcess
from pdserve.engine.real_model import real_model_path
from tests.helpers.cluster import client, kv_hits, start_cluster
from tests.helpers.real_model import CONVERSATIONS, _user

pytestmark = pytest.mark.slow  # real-model servers

# Long enough to reach the positions where the two used to part (generated tokens 1, 20 and 34).
MAX_TOKENS = 40
ENGINE_ARGS = ["--kv-cache-memory", "96MiB", "--max-model-len", "2048"]
NODE_ARGS = [*ENGINE_ARGS, "--chunk-size", str(CHUNK_SIZE), "--shutdown-timeout", "1"]
CHATS = [*CONVERSATIONS, _user("List three uses of a paperclip."),
         _user("Translate 'good morning, how are you?' into French and Spanish.")]


@pytest.fixture(scope="module")
def bf16_model():
    return real_model_path("smollm2", "bfloat16")


def _answers(url: str, model: str, prefix: str) -> list[list[int]]:
    """Each chat's greedy token ids, one request at a time (as a user trying it would send them)."""
    oai = client(url)
    out = []
    for i, chat in enumerate(CHATS):
        resp = oai.chat.completions.create(model=model, messages=chat, max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body={"return_token_ids": True, "ignore_eos": True},
                                           extra_headers={"X-Request-Id": f"{prefix}-{i}"})
        out.append(resp.choices[0].token_ids)
    return out


@pytest.fixture(scope="module")
def monolithic(bf16_model) -> list[list[int]]:
    server = ServerProcess("--model", str(bf16_model), *ENGINE_ARGS).start(timeout=300)
    try:
        return _answers(server.url, bf16_model.name, "mono")
    finally:
        server.stop()


@pytest.mark.parametrize("store", ["file", "redis"])
def test_pd_bf16_greedy_equals_pd_serve_token_for_token(store, bf16_model, monolithic, tmp_path):
    cluster = start_cluster(bf16_model, tmp_path, store=store, node_args=NODE_ARGS)
    try:
        answers = _answers(cluster.url, bf16_model.name, store)
        report = {r["request_id"]: r for r in kv_hits(*(n.log_file for n in cluster.prefill + cluster.decode))
                  ["requests"]}
    finally:
        cluster.stop()
    parted = [(i, next(j for j, (a, b) in enumerate(zip(p, m)) if a != b))
              for i, (p, m) in enumerate(zip(answers, monolithic)) if p != m]
    assert not parted, f"P/D over {store} parts from pd-serve at (chat, generated token): {parted}"
    assert all(len(a) == MAX_TOKENS for a in answers)
    for i in range(len(CHATS)):  # every prompt token's KV came from the store (or the decode node's own
        row = report[f"{store}-{i}"]  # prefix cache), the last one's included: decode computed none of them
        assert row["recomputed"] == 0 and row["loaded"] > 0 and not row["fallback"], row
