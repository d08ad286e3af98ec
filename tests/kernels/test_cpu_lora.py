"""The compiled multi-LoRA kernel (kernels/csrc/cpu_lora.c) against the torch reference (layers.add_lora per
adapter's rows), and the engine's batched path (stacked.py) on it against its torch path.

Each case runs in one build per vector path of the source (AVX-512F, AVX2 + FMA as on a Zen 3, plain C), a level
this CPU (or the PDSERVE_CPU_ISA cap) lacks skipping with a reason; each build is checked to target its level.
Data: slots of different ranks below the stack's rank, a part an adapter does not target, parts of widths
that are not whole 16-column panels, base-model rows (slot -1), row counts 1..33 (shrink tiles of 4 and 2 rows,
partial ones), bf16 and fp32 x and y. The kernel sums in another order than torch, so fp32 results agree within
fp32 rounding; bf16 ones are the same fp32 sum rounded once, so they agree within one bf16 step.
"""
from __future__ import annotations

import pytest
import torch

from pdserve.common import env
from pdserve.common.kernel_choice import use_backend
from pdserve.engine.lora.adapter import LoRAModule, LoRAPart
from pdserve.engine.lora.layers import add_lora
from pdserve.engine.lora.stacked import LoRAStack, RowSlots, add_lora_stacked
from pdserve.kernels import cpu_lora
from pdserve.kernels.cpu_lora import LoRAKernel, LoRAWeights
from tests.helpers.kernels import built_level, level_params, require

WIDTHS, IN, RANK = (72, 17, 33), 100, 8  # q-, k- and v-like parts; none a whole number of 16-column panels


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kernels")


@pytest.fixture(scope="module", params=level_params("avx512", "avx2", "c"))
def kernel(request, build_dir) -> LoRAKernel:
    level = require(request.param)
    assert built_level(cpu_lora.SOURCE, level.flags) == level.name
    return LoRAKernel(build_dir, level.flags)


def _module(gen: torch.Generator, ranks: tuple[int | None, ...]) -> LoRAModule:
    """An adapter's pairs on one layer: part p of rank ranks[p] (None: not targeted), weights at the scale of
    trained ones (A by 1/sqrt(in), B to a delta about 0.1x the input's)."""
    parts, start, offset = [], 0, 0
    for width, rank in zip(WIDTHS, ranks):
        if rank:
            parts.append(LoRAPart(offset, width, start, start + rank, torch.randn(width, rank, generator=gen) * 0.1))
            start += rank
        offset += width
    return LoRAModule(torch.randn(start, IN, generator=gen) / IN ** 0.5, tuple(parts))


def _adapters(gen: torch.Generator) -> list[tuple[LoRAModule, float]]:
    return [(_module(gen, (8, 8, 8)), 2.0), (_module(gen, (4, None, 3)), 0.5), (_module(gen, (None, 6, None)), 1.0)]


def _weights(adapters: list[tuple[LoRAModule, float]], gen: torch.Generator,
             dtype: torch.dtype = torch.float32) -> LoRAWeights:
    weights = LoRAWeights(len(adapters) + 1, RANK, IN, WIDTHS, dtype)
    for slot, (module, _) in enumerate(adapters):
        other = _module(gen, (8, 8, 8))  # a former occupant of the slot: clear() must hide it
        for p, part in enumerate(other.parts):
            weights.put(slot, p, other.a[part.rank_start:part.rank_end], part.b)
        weights.clear(slot)
        for part in module.parts:
            weights.put(slot, [0, 72, 89].index(part.offset), module.a[part.rank_start:part.rank_end], part.b)
    return weights  # the last slot stays empty (ranks 0): rows may not name it, the kernel must skip it


def _reference(y: torch.Tensor, x: torch.Tensor, slots: torch.Tensor,
               adapters: list[tuple[LoRAModule, float]]) -> torch.Tensor:
    want = y.clone()
    for slot, (module, scaling) in enumerate(adapters):
        rows = (slots == slot).nonzero()[:, 0]
        if len(rows):
            add_lora(want, x, module, scaling, rows)
    return want


def _rows(gen: torch.Generator, n: int, adapters: list[tuple[LoRAModule, float]]) -> tuple[torch.Tensor, ...]:
    slots = torch.randint(-1, len(adapters), (n,), generator=gen, dtype=torch.int32)
    slots[0] = n % len(adapters)  # at least one row under an adapter
    scaling = torch.tensor([adapters[s][1] if s >= 0 else 0.0 for s in slots.tolist()])
    return slots, scaling


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_gets_its_own_slot_s_delta(kernel, rows, dtype):
    gen = torch.Generator().manual_seed(rows)
    adapters = _adapters(gen)
    weights = _weights(adapters, gen)
    slots, scaling = _rows(gen, rows, adapters)
    x = torch.randn(rows, IN, generator=gen).to(dtype)
    y0 = torch.randn(rows, sum(WIDTHS), generator=gen).to(dtype)
    want = _reference(y0, x, slots, adapters)
    got = y0.clone()
    kernel(got, x, slots, scaling, weights)
    base = slots < 0
    assert torch.equal(got[base], y0[base])  # the base model's rows: untouched
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # one rounding of nearly the same fp32 sum: equal, or one bf16 step apart where it lies near a tie
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-6)
        assert (got != want).float().mean() < 0.02
    assert not torch.allclose(got[~base].float(), y0[~base].float(), atol=1e-2)  # the deltas are not negligible


def _rounded(module: LoRAModule, dtype: torch.dtype) -> LoRAModule:
    """The module with its weights rounded to dtype (what `--lora-dtype` does at load), kept in fp32."""
    return LoRAModule(module.a.to(dtype).float(), tuple(
        LoRAPart(p.offset, p.rows, p.rank_start, p.rank_end, p.b.to(dtype).float()) for p in module.parts))


@pytest.mark.parametrize("rows", [1, 4, 9, 33])
def test_bf16_weights_are_the_rounded_adapter_read_at_half_the_bytes(kernel, rows):
    """Weights held in bf16 (`--lora-dtype auto` on a bf16 model) give what fp32 weights rounded to bf16 give:
    the kernel widens them exactly, so only the sums' order differs from the reference."""
    gen = torch.Generator().manual_seed(100 + rows)
    adapters = _adapters(gen)
    weights = _weights(adapters, gen, torch.bfloat16)
    assert weights.a.dtype == weights.bt.dtype == torch.bfloat16
    slots, scaling = _rows(gen, rows, adapters)
    x = torch.randn(rows, IN, generator=gen)
    y0 = torch.randn(rows, sum(WIDTHS), generator=gen)
    got = y0.clone()
    kernel(got, x, slots, scaling, weights)
    rounded = [(_rounded(module, torch.bfloat16), scaling) for module, scaling in adapters]
    torch.testing.assert_close(got, _reference(y0, x, slots, rounded), rtol=1e-5, atol=1e-5)
    unrounded = _reference(y0, x, slots, adapters)
    assert not torch.allclose(got, unrounded, rtol=1e-5, atol=1e-5)  # the rounding is really there
    torch.testing.assert_close(got, unrounded, rtol=0, atol=0.05)  # and no more than a bf16 rounding of weights


@pytest.mark.parametrize("x_dtype,y_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_mixed_dtypes_and_a_strided_x(kernel, x_dtype, y_dtype):
    gen = torch.Generator().manual_seed(7)
    adapters = _adapters(gen)
    weights = _weights(adapters, gen)
    slots, scaling = _rows(gen, 11, adapters)
    wide = torch.randn(11, IN + 9, generator=gen).to(x_dtype)
    x = wide[:, 5:5 + IN]  # a view with a row stride wider than its rows
    y0 = torch.randn(11, sum(WIDTHS), generator=gen).to(y_dtype)
    want = _reference(y0.float(), x.float(), slots, adapters).to(y_dtype)
    got = y0.clone()
    kernel(got, x, slots, scaling, weights)
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7 if y_dtype == torch.bfloat16 else 1e-5,
                               atol=1e-5)


def test_no_row_under_an_adapter_leaves_y_alone(kernel):
    gen = torch.Generator().manual_seed(1)
    weights = _weights(_adapters(gen), gen)
    y0 = torch.randn(5, sum(WIDTHS), generator=gen)
    got = y0.clone()
    kernel(got, torch.randn(5, IN, generator=gen), torch.full((5,), -1, dtype=torch.int32), torch.zeros(5), weights)
    assert torch.equal(got, y0)
    kernel(got[:0], torch.zeros(0, IN), torch.zeros(0, dtype=torch.int32), torch.zeros(0), weights)


def test_shapes_that_do_not_fit_raise(kernel):
    weights = LoRAWeights(2, RANK, IN, WIDTHS)
    slots, scaling = torch.zeros(3, dtype=torch.int32), torch.ones(3)
    with pytest.raises(ValueError):
        kernel(torch.zeros(3, sum(WIDTHS)), torch.zeros(3, IN + 1), slots, scaling, weights)
    with pytest.raises(ValueError):
        kernel(torch.zeros(3, sum(WIDTHS)), torch.zeros(3, IN), slots.long(), scaling, weights)
    with pytest.raises(ValueError):
        kernel(torch.zeros(3, sum(WIDTHS)).half(), torch.zeros(3, IN), slots, scaling, weights)
    with pytest.raises(ValueError):
        weights.put(0, 1, torch.zeros(RANK + 1, IN), torch.zeros(17, RANK + 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_engine_s_stack_on_the_kernel_equals_its_torch_path(dtype):
    """stacked.py: on CPU the stack takes the kernel (the build of this machine's level); with the torch backend
    forced, its torch layout. Same rows, same deltas within fp32 rounding (fp16 y: widened for the kernel)."""
    gen = torch.Generator().manual_seed(5)
    adapters = _adapters(gen)
    compiled = LoRAStack(len(adapters), RANK, IN, WIDTHS, torch.device("cpu"))
    if env.value(env.KERNELS).strip() == "torch":
        pytest.skip("PDSERVE_KERNELS=torch keeps every compiled path off")
    assert compiled.kernel is not None, "the compiled LoRA kernel did not build here (its warning says why)"
    with use_backend("torch"):
        plain = LoRAStack(len(adapters), RANK, IN, WIDTHS, torch.device("cpu"))
    assert plain.kernel is None
    for stack in (compiled, plain):
        for slot, (module, _) in enumerate(adapters):
            stack.write(slot, module)
    slots, scaling = _rows(gen, 13, adapters)
    rows = RowSlots(slots, scaling, len(adapters), torch.device("cpu"))
    x = torch.randn(13, IN, generator=gen).to(dtype)
    y0 = torch.randn(13, sum(WIDTHS), generator=gen).to(dtype)
    got, want = y0.clone(), y0.clone()
    add_lora_stacked(got, x, compiled, rows)
    add_lora_stacked(want, x, plain, rows.table)  # the [rows, slots] table form converts to the same rows
    tol = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=1e-5)
