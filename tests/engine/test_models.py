"""Our paged-KV forward pass against transformers on the same random weights (fp32)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.engine.attention import ForwardContext, set_forward_context
from pdserve.engine.builtin_model import make_model
from pdserve.engine.config import KVRole
from pdserve.engine.kv_connector import KVConnectorBase
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler_output import SchedulerOutput
from pdserve import kernels
from tests.helpers.model_steps import ATOL, BLOCK, check_against_hf, make_runner, prompt, step
from tests.helpers.oracles import hf_logits


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
@pytest.mark.slow  # seconds: outside make test-quick
def test_bf16_logits_within_tolerance_of_hf(tmp_path, arch):
    """bf16 weights on CPU (oneDNN's bf16 GEMM, or engine/models/linear.py's compiled bf16 kernel where
    the CPU has no bf16 instructions), through chunked prefill over paged history and decode steps:
    our logits are as close to HF's fp32 logits as HF's own bf16 logits are, and pick the same greedy
    token wherever HF's top two are further apart than that error."""
    path = make_model(tmp_path / "m", arch=arch, dtype="bfloat16")
    runner = make_runner(path)
    a = Request("a", prompt(40, 7), SamplingParams(temperature=0))
    tables, got = {"a": [6, 1, 4, 8]}, []
    for n in [17, 23, 1, 1, 1, 1]:  # prefill chunks ending mid-block, then decode steps
        got.append(step(runner, [(a, n)], tables)["a"].float())
        a.num_computed_tokens += n
        if a.num_computed_tokens == a.num_tokens:
            a.append_output_token(int(got[-1][-1].argmax()))
    ours = torch.cat(got)
    ref32 = hf_logits(path, a.all_token_ids)[:ours.shape[0]]
    ref16 = hf_logits(path, a.all_token_ids, torch.bfloat16)[:ours.shape[0]]
    ours_err, hf_err = (ours - ref32).abs(), (ref16 - ref32).abs()
    assert float(ours_err.mean()) <= 2 * float(hf_err.mean()) + 1e-3
    assert float(ours_err.max()) <= 2 * float(hf_err.max()) + 0.02
    top2 = ref32.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * float(ours_err.max())
    assert clear.sum() >= ours.shape[0] // 2  # the check below covers most positions
    assert torch.equal(ours.argmax(-1)[clear], ref32.argmax(-1)[clear])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])  # 4 query heads: GQA ratios 1, 2 and 4
def test_logits_match_transformers(tmp_path, arch, num_kv_heads):
    path = make_model(tmp_path / "m", arch=arch, num_kv_heads=num_kv_heads)
    check_against_hf(path)


@pytest.mark.slow  # seconds: outside make test-quick
def test_mistral_and_llama3_rope_scaling_match_transformers(tmp_path):
    check_against_hf(make_model(tmp_path / "mistral", arch="mistral"))
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    check_against_hf(make_model(tmp_path / "llama3", rope_parameters=rope))


@pytest.mark.parametrize("num_kv_heads", [4, 1])
def test_qwen3_matches_transformers(tmp_path, num_kv_heads):
    """Qwen3: q and k RMSNorm per head before RoPE, no qkv bias, tied embeddings, and (as in the real models)
    a head_dim of 64 where hidden_size / heads is 32."""
    path = make_model(tmp_path / "m", arch="qwen3", head_dim=64, num_kv_heads=num_kv_heads)
    names = load_file(path / "model.safetensors").keys()
    assert "model.layers.0.self_attn.k_norm.weight" in names and "model.layers.0.self_attn.q_proj.bias" not in names
    check_against_hf(path)


def test_gemma3_matches_transformers(tmp_path):
    """Gemma 3: (1 + weight) norms, four a layer, q/k norms per head, scores scaled by query_pre_attn_scalar
    (24, not head_dim), the embedding times sqrt(hidden_size), a GELU-tanh MLP, sliding-window layers with
    their own RoPE base beside linear-scaled global ones, and a final logit soft-cap. The sliding window
    (512) caps max_model_len: within it, sliding attention is full attention."""
    path = make_model(tmp_path / "m", arch="gemma3", query_pre_attn_scalar=24, final_logit_softcapping=30.0)
    config = json.loads((path / "config.json").read_text())
    assert {"sliding_attention", "full_attention"} == set(config["layer_types"])
    check_against_hf(path)
    assert make_runner(path).max_model_len == 512


def test_qwen2_checkpoint_has_bias_and_tied_embeddings(tiny_qwen2):
    names = load_file(tiny_qwen2 / "model.safetensors").keys()
    assert "lm_head.weight" not in names
    assert "model.layers.0.self_attn.q_proj.bias" in names


class RecordingConnector(KVConnectorBase):
    """A worker-side connector that loads a given prefix's KV into paged memory in wait_for_layer_load."""

    def __init__(self, loads: dict[int, tuple[torch.Tensor, torch.Tensor]], failed: set[str]) -> None:
        super().__init__(KVRole.BOTH)
        self.loads, self.failed, self.calls, self.saved = loads, failed, [], {}

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        return None

    def register_kv_caches(self, kv_caches):
        self.kv_caches = kv_caches

    def start_load_kv(self, metadata):
        self.calls.append(("start_load", None))

    def wait_for_layer_load(self, layer_idx):
        self.calls.append(("load", layer_idx))
        if layer_idx in self.loads:
            slots, buf = self.loads[layer_idx]
            kernels.scatter_kv(self.kv_caches[layer_idx], slots, buf)

    def save_kv_layer(self, layer_idx, kv_cache, metadata):
        self.calls.append(("save", layer_idx))
        self.saved[layer_idx] = kv_cache.clone()

    def wait_for_save(self):
        self.calls.append(("wait_save", None))

    def get_failed_loads(self):
        return set(self.failed)


def test_connector_hooks_load_prefix_and_save_each_layer(tiny_llama):
    """A 'decode node' computes only the last prompt token; the connector loads the rest per layer."""
    tokens = prompt(40, 3)
    table = [4, 1, 6]
    producer = make_runner(tiny_llama)
    req = Request("p", tokens, SamplingParams(temperature=0))
    step(producer, [(req, 40)], {"p": table})
    slots = torch.arange(39)
    slots = torch.tensor(table)[slots // BLOCK] * BLOCK + slots % BLOCK
    loads = {i: (slots, kernels.gather_kv(producer.kv_caches[i], slots)) for i in range(producer.num_layers)}

    connector = RecordingConnector(loads, failed=set())
    consumer = make_runner(tiny_llama, connector)
    req2 = Request("c", tokens, SamplingParams(temperature=0, logprobs=True))
    req2.num_computed_tokens = 39
    so = SchedulerOutput([req2], {"c": 1}, {"c": table}, 1)
    out = consumer.execute_model(so)
    ref = hf_logits(tiny_llama, tokens)[-1]
    assert out.sampled_token_ids == {"c": int(ref.argmax())}
    assert out.logprobs["c"] == pytest.approx(float(torch.log_softmax(ref, -1).max()), abs=ATOL)
    layers = range(consumer.num_layers)
    expected = [("start_load", None)] + [c for i in layers for c in (("load", i), ("save", i))] + [("wait_save", None)]
    assert connector.calls == expected
    last_slot = table[39 // BLOCK] * BLOCK + 39 % BLOCK
    for i in layers:  # at save time, the layer's cache already holds this step's KV (zeros before)
        saved = connector.saved[i].view(2, -1, *connector.saved[i].shape[3:])[:, last_slot]
        reference = producer.kv_caches[i].view(2, -1, *producer.kv_caches[i].shape[3:])[:, last_slot]
        assert saved.abs().sum() > 0
        torch.testing.assert_close(saved, reference, atol=ATOL, rtol=0)


def test_failed_load_drops_sampled_token(tiny_llama):
    connector = RecordingConnector({}, failed={"x"})
    runner = make_runner(tiny_llama, connector)
    x = Request("x", prompt(5, 4), SamplingParams(temperature=0))
    y = Request("y", prompt(6, 5), SamplingParams(temperature=0))
    out = runner.execute_model(SchedulerOutput([x, y], {"x": 5, "y": 6}, {"x": [0], "y": [1]}, 11))
    assert out.failed_load_req_ids == {"x"}
    assert set(out.sampled_token_ids) == {"y"}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_last_layer_runs_only_the_kept_rows_past_attention(tmp_path, dtype):
    """keep_rows (engine/model_runner.py passes the sampled rows): the kept rows' hidden states are the
    full forward's rows, and every row's K/V still reaches every layer's cache, even with no row kept."""
    path = make_model(tmp_path / "m", dtype=dtype)
    a, b = Request("a", prompt(21, 1), SamplingParams()), Request("b", prompt(9, 2), SamplingParams())
    so = SchedulerOutput([a, b], {"a": 21, "b": 9}, {"a": [3, 5], "b": [1]}, 30)

    def forward(keep: list[int] | None):
        runner = make_runner(path)
        inputs = runner.inputs.prepare(so)
        with torch.inference_mode(), set_forward_context(ForwardContext(inputs.attn_metadata, runner.kv_caches,
                                                                        runner.attn_backend)):
            rows = None if keep is None else torch.tensor(keep, dtype=torch.long)
            return runner.model(inputs.input_ids, inputs.positions, rows), runner.kv_caches

    full, full_caches = forward(None)
    tol = {"atol": ATOL, "rtol": 0} if dtype == "float32" else {"atol": 2e-2, "rtol": 2e-2}
    for keep in ([20, 29], [29, 4, 0], []):
        hidden, caches = forward(keep)
        assert hidden.shape == (len(keep), full.shape[1])
        torch.testing.assert_close(hidden, full[keep], **tol)
        assert all(torch.equal(c, f) for c, f in zip(caches, full_caches))
        assert all(c[:, 1].abs().sum() > 0 for c in caches)  # b's block was written in every layer


def test_prefill_steps_sample_hf_tokens_with_the_last_layer_pruned(tiny_llama):
    """A mixed step (a decode, a prompt's middle chunk, a whole prompt) through execute_model: only the
    sampled rows pass the last layer, and the sampled tokens are HF's greedy ones."""
    runner = make_runner(tiny_llama)
    a = Request("a", prompt(33, 3), SamplingParams(temperature=0))
    b = Request("b", prompt(18, 4), SamplingParams(temperature=0))
    c = Request("c", prompt(40, 5), SamplingParams(temperature=0))
    tables = {"a": [0, 1, 2], "b": [3, 4], "c": [5, 6, 7]}
    out = runner.execute_model(SchedulerOutput([a, c], {"a": 33, "c": 16}, tables, 49))
    assert set(out.sampled_token_ids) == {"a"}  # c's first chunk samples nothing
    a.num_computed_tokens, c.num_computed_tokens = 33, 16
    a.append_output_token(out.sampled_token_ids["a"])
    out2 = runner.execute_model(SchedulerOutput([a, b, c], {"a": 1, "b": 18, "c": 24}, tables, 43))
    expected = {r.request_id: int(hf_logits(tiny_llama, r.all_token_ids)[-1].argmax()) for r in (a, b, c)}
    assert out.sampled_token_ids["a"] == int(hf_logits(tiny_llama, a.prompt_token_ids)[-1].argmax())
    assert out2.sampled_token_ids == expected


def test_unsupported_architecture_is_one_line_error(tmp_path, tiny_llama):
    shutil.copytree(tiny_llama, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as err:
        make_runner(tmp_path / "m")
    message = str(err.value)
    assert "\n" not in message and "GPTNeoXForCausalLM" in message
    assert all(a in message for a in ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM",
                                      "Qwen3ForCausalLM", "Gemma3ForCausalLM"))


def test_gemma_attention_soft_capping_is_refused(tmp_path):
    """Gemma 2's attention logit soft-cap is not in the attention backends: a start-up error, not wrong output."""
    path = make_model(tmp_path / "m", arch="gemma3", attn_logit_softcapping=50.0)
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        make_runner(path)


def test_sharded_safetensors_index(tmp_path, tiny_qwen2):
    sharded = tmp_path / "sharded"
    shutil.copytree(tiny_qwen2, sharded)
    weights = load_file(sharded / "model.safetensors")
    (sharded / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: weights[n] for n in part}, sharded / file, metadata={"format": "pt"})
    weight_map = {n: file for file, part in shards.items() for n in part}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    ours = make_runner(sharded).model.state_dict()
    single = make_runner(tiny_qwen2).model.state_dict()
    assert ours.keys() == single.keys()
    assert all(torch.equal(ours[k], single[k]) for k in ours)
    check_against_hf(sharded)

    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match="model-00002-of-00002"):
        make_runner(sharded)


@pytest.mark.parametrize("rows", [1, 3, 5, 17, 40, 100])
def test_bf16_linear_is_a_bf16_gemm_with_fp32_accumulation(rows):
    """Packed bf16 weights (oneDNN's bf16 path; on CPUs without bf16 instructions the compiled bf16
    kernel) give the fp32 product of the bf16 inputs plus the bias, rounded to bf16, for 2-d and
    3-d activations. 50 outputs: the kernel's 16-column panels leave a partial one."""
    from pdserve.engine.models.linear import Linear

    g = torch.Generator().manual_seed(rows)
    lin = Linear(64, 50, True, torch.bfloat16)
    lin.weight.data.copy_(torch.randn(50, 64, generator=g))
    lin.bias.data.copy_(torch.randn(50, generator=g))
    w, b = lin.weight.detach().float().clone(), lin.bias.detach().float().clone()
    lin.pack()
    x = torch.randn(rows + 3, 64, generator=g).to(torch.bfloat16)[3:]  # rows at an offset
    y = lin(x)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 50)
    torch.testing.assert_close(y.float(), (x.float() @ w.T + b).to(torch.bfloat16).float(), atol=1e-2, rtol=1e-2)
    assert torch.equal(lin(x.view(1, rows, 64)), y.view(1, rows, 50))
