"""Reading PEFT directories: what is refused (with a message naming it), the scaling, the fingerprint, and
the LoRA layer's arithmetic against PEFT's own layer in fp32 and bf16."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from pdserve.engine.config import LoRAConfig
from pdserve.engine.lora.adapter import LoRAError, LoRAModule, LoRAPart, TargetLayout
from pdserve.engine.lora.layers import add_lora
from pdserve.engine.lora.peft_format import read_adapter
from pdserve.engine.lora.request import LoRARequest
from tests.helpers.lora_adapters import edit_config, make_adapter

# the tiny preset: hidden 128, 4 heads x 32, 2 kv heads, intermediate 256, 4 layers
LAYOUT = TargetLayout(4, (0, 1, 2, 3), {"qkv_proj": (128, (128, 64, 64)), "o_proj": (128, (128,)),
                                        "gate_up_proj": (128, (256, 256)), "down_proj": (256, (128,))})


@pytest.fixture(scope="module")
def adapter_dir(tiny_llama, tmp_path_factory):
    return make_adapter(tiny_llama, tmp_path_factory.mktemp("peft") / "a", r=8, alpha=16, seed=1)


def copy(adapter_dir, tmp_path):
    return shutil.copytree(adapter_dir, tmp_path / "copy")


def read(path, max_rank: int = 64):
    return read_adapter(LoRARequest("x", 1, str(path)), LAYOUT, max_rank)


def test_a_peft_adapter_is_laid_out_for_the_fused_layers(adapter_dir):
    adapter = read(adapter_dir)
    assert adapter.rank == 8 and adapter.scaling == 2.0
    qkv = adapter.modules[(0, "qkv_proj")]
    assert qkv.a.shape == (24, 128) and qkv.a.dtype == torch.float32
    assert sorted((p.offset, p.rows) for p in qkv.parts) == [(0, 128), (128, 64), (192, 64)]
    assert adapter.modules[(3, "down_proj")].a.shape == (8, 256)
    assert read(adapter_dir).fingerprint == adapter.fingerprint  # the content, not the load, names it


@pytest.mark.parametrize("change, message", [
    (dict(use_dora=True), "DoRA"), (dict(bias="lora_only"), "bias='lora_only'"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"), (dict(rank_pattern={"q_proj": 4}), "rank_pattern"),
    (dict(target_modules=["q_proj", "embed_tokens"]), "embed_tokens are not supported"),
    (dict(peft_type="IA3"), "is not LORA"), (dict(r=128), "rank 128, above max_lora_rank=64"),
    (dict(lora_alpha=32), None), (dict(use_rslora=True), None),
])
def test_config_changes_are_read_or_refused_by_name(adapter_dir, tmp_path, change, message):
    path = edit_config(copy(adapter_dir, tmp_path), **change)
    if message is None:
        adapter = read(path)
        assert adapter.scaling == (32 / 8 if "lora_alpha" in change else 16 / 8 ** 0.5)
        assert adapter.fingerprint != read(adapter_dir).fingerprint  # the scaling is part of its identity
        return
    with pytest.raises(LoRAError, match=message):
        read(path)


def test_broken_directories_are_refused(adapter_dir, tmp_path):
    with pytest.raises(LoRAError, match="does not exist"):
        read(tmp_path / "missing")
    path = copy(adapter_dir, tmp_path)
    (path / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoRAError, match="not JSON"):
        read(path)
    path.joinpath("adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16}))
    path.joinpath("adapter_model.safetensors").write_bytes(b"\0" * 10)
    with pytest.raises(LoRAError, match="cannot read adapter_model.safetensors"):
        read(path)
    other = TargetLayout(4, (0, 1, 2, 3), {**LAYOUT.parts, "qkv_proj": (64, (64, 32, 32))})
    with pytest.raises(LoRAError, match="another base model"):
        read_adapter(LoRARequest("x", 1, str(adapter_dir)), other, 64)


def test_lora_dtype_rounds_the_weights_and_names_them_in_the_fingerprint(adapter_dir):
    """`--lora-dtype`: weights rounded to it at load (held in fp32: every path computes with the same values), and
    a fingerprint of its own, so KV computed under rounded weights never meets KV of the exact ones; fp32 reads
    as before (its fingerprints do not change)."""
    exact = read(adapter_dir)
    assert read_adapter(LoRARequest("x", 1, str(adapter_dir)), LAYOUT, 64, torch.float32).fingerprint \
        == exact.fingerprint
    rounded = read_adapter(LoRARequest("x", 1, str(adapter_dir)), LAYOUT, 64, torch.bfloat16)
    assert rounded.fingerprint != exact.fingerprint and rounded.num_bytes == exact.num_bytes
    for key, module in exact.modules.items():
        got = rounded.modules[key]
        assert got.a.dtype == torch.float32 and torch.equal(got.a, module.a.to(torch.bfloat16).float())
        for part, exact_part in zip(got.parts, module.parts):
            assert torch.equal(part.b, exact_part.b.to(torch.bfloat16).float())
    assert any(not torch.equal(rounded.modules[k].a, m.a) for k, m in exact.modules.items())
    with pytest.raises(ValueError, match="lora_dtype must be one of auto, float32, bfloat16, float16"):
        LoRAConfig(enable_lora=True, lora_dtype="int8")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_lora_delta_is_peft_s_on_the_rows_of_the_group(dtype):
    """PEFT keeps adapter weights in fp32 (autocast_adapter_dtype) and adds its delta in fp32; so do we, bit for
    bit on the group's rows. The base layer's own output for a row may depend on how many rows its matmul had
    (fp32 on some CPUs), which is not LoRA's arithmetic: the group's rows start from the base output PEFT sees."""
    from peft import LoraConfig, get_peft_model

    gen = torch.Generator().manual_seed(0)
    holder = torch.nn.Module()
    holder.q_proj = torch.nn.Linear(32, 48, bias=False).to(dtype)
    peft_model = get_peft_model(holder, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    peft_layer = peft_model.base_model.model.q_proj
    base = peft_layer.base_layer
    for p in (peft_layer.lora_A["default"].weight, peft_layer.lora_B["default"].weight):
        p.data = torch.randn(p.shape, generator=gen)  # fp32, as PEFT keeps them
    x = torch.randn(6, 32, generator=gen).to(dtype)

    a, b = peft_layer.lora_A["default"].weight.data, peft_layer.lora_B["default"].weight.data
    module = LoRAModule(a, (LoRAPart(0, 48, 0, 4, b),))
    with torch.no_grad():
        rows = torch.tensor([1, 4])
        want = peft_layer(x[rows])
        y = base(x)
        y.index_copy_(0, rows, base(x[rows]))
        add_lora(y, x, module, 2.0, rows)
    assert torch.equal(y[rows], want)
    assert torch.equal(y[[0, 2, 3, 5]], base(x)[[0, 2, 3, 5]])  # the other rows (the base model's) untouched


def test_the_stacked_slots_give_each_row_its_own_adapter_s_delta():
    """The batched path (stacked.py): rows of three adapters (one on q only, of a lower rank) and of the base
    model in one step equal add_lora's per group within fp32 rounding. Not bit for bit: the scaling multiplies
    x A^T rather than its product with B, and the expand sums over every slot's rank columns (exact zeros
    outside the row's slot) with another blocking, so each output may differ from add_lora's by a few fp32
    ulps of the terms summed (here of order 1, the weights scaled as trained adapters': A by 1/sqrt(in), B to
    a delta about 0.1x the input's scale): within 1e-5, absolute and relative."""
    from pdserve.engine.lora.stacked import LoRAStack, add_lora_stacked

    gen = torch.Generator().manual_seed(3)
    widths, r_max = (128, 64, 64), 8

    def module(ranks: list[int | None]) -> LoRAModule:
        parts, start = [], 0
        for (offset, rows), rank in zip(((0, 128), (128, 64), (192, 64)), ranks):
            if rank:
                b = torch.randn(rows, rank, generator=gen) * 0.1 / rank ** 0.5
                parts.append(LoRAPart(offset, rows, start, start + rank, b))
                start += rank
        return LoRAModule(torch.randn(start, 128, generator=gen) / 128 ** 0.5, tuple(parts))

    adapters = [(module([8, 8, 8]), 2.0), (module([4, None, None]), 0.5), (module([8, 8, 8]), 1.0)]
    stack = LoRAStack(3, r_max, 128, widths, torch.device("cpu"))
    stack.write(1, module([8, 8, 8]))  # a former occupant: write() must clear it
    for slot, (m, _) in enumerate(adapters):
        stack.write(slot, m)
    x = torch.randn(7, 128, generator=gen)
    row_slot = [0, 3, 1, 2, 0, 3, 1]  # 3: the base model
    scale = torch.zeros(7, 3)
    for row, slot in enumerate(row_slot):
        if slot < 3:
            scale[row, slot] = adapters[slot][1]
    y0 = torch.randn(7, 256, generator=gen)
    want = y0.clone()
    for slot, (m, scaling) in enumerate(adapters):
        add_lora(want, x, m, scaling, torch.tensor([r for r, s in enumerate(row_slot) if s == slot]))
    assert not torch.allclose(want[[0, 2, 3]], y0[[0, 2, 3]], atol=1e-3)  # the deltas are not negligible
    got = y0.clone()
    add_lora_stacked(got, x, stack, scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[[1, 5]], y0[[1, 5]])  # the base model's rows: untouched
    bf16 = y0.bfloat16()
    add_lora_stacked(bf16, x.bfloat16(), stack, scale)  # one rounding of the fp32 sum into bf16
    assert torch.equal(bf16[[1, 5]], y0.bfloat16()[[1, 5]])
