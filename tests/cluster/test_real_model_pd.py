"""SmolLM2-135M-Instruct through P/D (proxy -> prefill node -> KV store -> decode node), over the file store and
over redis: greedy chat outputs equal HF's token for token (fp32) with the prompt's KV loaded from the store,
and n=2 seeded sampling equals the monolithic engine's choices."""
from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from pdserve.deploy.processes import CHUNK_SIZE
from pdserve.engine.tokenizer import load_tokenizer
from tests.helpers.cluster import client, kv_hits, log_lines, start_cluster
from tests.helpers.real_model import CONVERSATIONS, MAX_TOKENS, chat_ids, near_ties

pytestmark = pytest.mark.slow  # P/D clusters on the real model

# fp32 KV of this model is 45 KiB a token: 192 MiB holds about 4,300 tokens, so the 1,200-token prompt fits.
NODE_ARGS = ["--dtype", "float32", "--kv-cache-memory", "192MiB", "--max-model-len", "2048",
             "--chunk-size", str(CHUNK_SIZE), "--shutdown-timeout", "1"]
PD_CONVERSATIONS = [CONVERSATIONS[i] for i in (0, 4, 5)]  # 37, 242 and about 1,200 tokens
SAMPLED = dict(n=2, temperature=0.8, top_p=0.95, seed=1234, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def monolithic(smollm2) -> list[list[int]]:
    """The offline engine's n=2 seeded choices (token ids) for the 242-token conversation."""
    llm = LLM(str(smollm2), dtype="float32", kv_cache_memory="64MiB")
    out = llm.chat(PD_CONVERSATIONS[1], SamplingParams(ignore_eos=True, **SAMPLED))[0]
    return [c.token_ids for c in out.outputs]


@pytest.fixture(scope="module", params=["file", "redis"])
def cluster(request, smollm2, tmp_path_factory):
    c = start_cluster(smollm2, tmp_path_factory.mktemp(f"smollm2-{request.param}"), store=request.param,
                      node_args=NODE_ARGS)
    c.store_name = request.param
    yield c
    c.stop()


def test_pd_greedy_chat_equals_hf_with_the_prompt_loaded_from_the_store(cluster, smollm2):
    oai = client(cluster.url)
    assert oai.models.list().data[0].id == smollm2.name
    tokenizer = load_tokenizer(smollm2)
    prompts, outputs, rids = [chat_ids(tokenizer, c) for c in PD_CONVERSATIONS], [], []
    for i, conversation in enumerate(PD_CONVERSATIONS):
        rids.append(f"{cluster.store_name}-greedy-{i}")
        resp = oai.chat.completions.create(model=smollm2.name, messages=conversation, max_tokens=MAX_TOKENS,
                                           temperature=0, extra_body={"return_token_ids": True},
                                           extra_headers={"X-Request-Id": rids[-1]})
        assert resp.prompt_token_ids == prompts[i]
        # cached: the prefill node's hits on earlier requests' KV (its "prefill done" line), as pd-serve counts
        # them, not this request's own hand-off (the decode node loads every prompt token: kv_hits below)
        done = [line for line in log_lines(cluster.prefill[0].log_file, rids[-1]) if "prefill done" in line]
        assert f": {len(prompts[i])} prompt tokens, {resp.usage.prompt_tokens_details.cached_tokens} cached, KV " \
            "committed" in done[0], done
        outputs.append(resp.choices[0].token_ids)
    ties = near_ties(smollm2, prompts, outputs)
    print(f"{cluster.store_name}: near ties: {ties or 'none'}")
    assert len(ties) <= 1, ties
    assert tokenizer.decode(outputs[0], skip_special_tokens=True) == "The capital of France is Paris."
    report = {r["request_id"]: r for r in kv_hits(*(n.log_file for n in cluster.prefill + cluster.decode))["requests"]}
    for rid, prompt in zip(rids, prompts):
        assert report[rid]["stored"] == len(prompt) and report[rid]["loaded"] >= len(prompt) - CHUNK_SIZE, report[rid]


def test_pd_seeded_n2_sampling_equals_monolithic(cluster, smollm2, monolithic):
    resp = client(cluster.url).chat.completions.create(
        model=smollm2.name, messages=PD_CONVERSATIONS[1], extra_body={"return_token_ids": True, "ignore_eos": True},
        **SAMPLED)
    choices = [c.token_ids for c in sorted(resp.choices, key=lambda c: c.index)]
    assert choices == monolithic and choices[0] != choices[1]
