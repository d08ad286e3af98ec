"""The linear path of bf16 layers, chosen by measurement (kernels/linear_choice.py) and used by
engine/models/linear.py: the choice follows the numbers it is fed (never a CPU's name), the
measurement is bounded and cached, the overrides win, and every path a layer may take gives a bf16
GEMM's result (fp32 sums of the exact products, rounded to bf16) for decode- and prefill-sized calls."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

import pytest
import torch

from pdserve.common import cpu_isa
from pdserve.engine.models.linear import Linear
from pdserve.kernels import linear_choice, linear_paths
from pdserve.kernels.linear_choice import LARGE_FROM, MIN_GAIN, choose
from tests.helpers.kernels import level_param, require, runs


@pytest.fixture()
def fresh(monkeypatch, tmp_path):
    """A process with no choice made yet and its own cache directory."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(linear_choice.ENV, raising=False)
    monkeypatch.setattr(linear_choice, "_chosen", {})
    return tmp_path / "cache" / "kernels"


def test_choice_follows_the_numbers_per_kind_of_call():
    """Numbers as measured on a Xeon with AVX-512 and no bf16 (oneDNN's bf16 GEMM emulated): the widening
    kernel for decode-sized calls, oneDNN's fp32 GEMM for prefill-sized ones. The same names with other
    numbers choose otherwise: the choice reads the measurement, nothing else."""
    xeon = {"small": {"onednn_bf16": 49.0, "onednn_fp32": 112.0, "bf16_widen": 169.0},
            "large": {"onednn_bf16": 71.0, "onednn_fp32": 201.0, "bf16_widen": 157.0}}
    c = choose(xeon)
    assert c.small == ("bf16_widen", "onednn_fp32", "onednn_bf16")
    assert c.large == ("onednn_fp32", "bf16_widen", "onednn_bf16")
    assert c.ranking(LARGE_FROM - 1) == c.small and c.ranking(LARGE_FROM) == c.large
    amx = {"small": {"onednn_bf16": 900.0, "onednn_fp32": 112.0, "bf16_widen": 169.0},
           "large": {"onednn_bf16": 2500.0, "onednn_fp32": 201.0, "bf16_widen": 157.0}}
    assert choose(amx).small[0] == choose(amx).large[0] == "onednn_bf16"


def test_a_second_layout_only_for_a_clear_gain():
    """Where the prefill-sized winner beats the decode-sized winner's own prefill figure by less than
    MIN_GAIN, the decode-sized winner serves both (one layout of the weights, not two)."""
    close = {"small": {"bf16_dot": 400.0, "onednn_bf16": 290.0},
             "large": {"bf16_dot": 420.0, "onednn_bf16": 420.0 * (1 + MIN_GAIN) - 1}}
    assert choose(close).large == ("bf16_dot", "onednn_bf16")
    clear = {"small": close["small"], "large": {"bf16_dot": 420.0, "onednn_bf16": 420.0 * (1 + MIN_GAIN) + 1}}
    assert choose(clear).large == ("onednn_bf16", "bf16_dot")


def test_a_slow_machine_stops_measuring_at_the_deadline(monkeypatch):
    """However slow the calls, each kind of call stops after its second pass once DEADLINE_S has passed: here
    every call takes longer than the deadline, so each path runs exactly two passes per kind (the first one
    only warms up), where a fast machine stops after BUDGET_S of timed calls per path. Counted, not timed."""
    monkeypatch.setattr(linear_choice, "DEADLINE_S", 0.001)
    monkeypatch.setattr(linear_choice, "_llc_bytes", lambda: 0)  # two weight copies per kind
    calls: dict[str, int] = {}

    def slow(name):
        def run(state, x):
            calls[name] = calls.get(name, 0) + 1
            time.sleep(0.002)
        return run

    fake = {name: dataclasses.replace(linear_paths.PATHS[name], run=slow(name)) for name in ("onednn_fp32",)}
    monkeypatch.setattr(linear_paths, "PATHS", {**linear_paths.PATHS, **fake})
    figures, _ = linear_choice.measure(("onednn_fp32",))
    assert calls == {"onednn_fp32": 2 * 2 + 2 * 2}  # (2 passes x 2 copies) per kind, 2 kinds
    assert all(figures[kind]["onednn_fp32"] > 0 for kind in figures)


@pytest.mark.slow  # seconds: outside make test-quick
def test_measurement_is_bounded_and_cached(fresh, caplog, monkeypatch):
    """The first choice measures every available path, writes its numbers as JSON and logs one line with the
    CPU and the chosen paths' GFLOP/s; a restart reads the file instead (no second measurement); a damaged
    file is measured again. (Caching whatever the machine's load: the rule for a contended measurement is
    checked below; the bound on its time, in passes rather than seconds, in the next test.)"""
    monkeypatch.setattr(linear_choice, "MIN_CORE_SHARE", 0.0)
    paths = linear_paths.available()
    with caplog.at_level(logging.INFO, logger="pdserve.kernels.linear_choice"):
        first = linear_choice.linear_choice()
    assert set(first.small) == set(first.large) == set(paths) and first.source.startswith("measured in")
    lines = [r.getMessage() for r in caplog.records if r.name == "pdserve.kernels.linear_choice"]
    assert len(lines) == 1 and "GFLOP/s" in lines[0] and first.small[0] in lines[0]
    assert f"CPU {cpu_isa.model_name()!r}" in lines[0]
    files = list(fresh.glob("linear-choice-*.json"))
    assert len(files) == 1
    saved = json.loads(files[0].read_text())
    assert set(saved["gflops"]["small"]) == set(paths) and all(v > 0 for v in saved["gflops"]["large"].values())

    linear_choice._chosen.clear()
    again = linear_choice.linear_choice()
    assert again.source.startswith("cached in") and again.small == first.small and again.large == first.large

    files[0].write_text("{not json")
    linear_choice._chosen.clear()
    assert linear_choice.linear_choice().source.startswith("measured in")


@pytest.mark.slow  # seconds: outside make test-quick
def test_a_contended_measurement_is_not_cached(fresh, caplog, monkeypatch):
    """A measurement whose thread had the core for less than MIN_CORE_SHARE of its time serves this process
    but is not written: its numbers say more about the neighbours than about the paths. (A share above 1
    stands for a machine busy enough to fail any measurement.)"""
    monkeypatch.setattr(linear_choice, "MIN_CORE_SHARE", 1.01)
    with caplog.at_level(logging.INFO, logger="pdserve.kernels.linear_choice"):
        choice = linear_choice.linear_choice()
    assert "not cached, the next start measures again" in choice.source and choice.source in caplog.text
    assert choice.small and not list(fresh.glob("linear-choice-*.json"))


def _layer(seed: int, n: int = 100, k: int = 256) -> tuple[Linear, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lin = Linear(k, n, True, torch.bfloat16)
    w, b = (torch.randn(n, k, generator=g) * 0.1).bfloat16(), torch.randn(n, generator=g).bfloat16()
    lin.weight.data.copy_(w)
    lin.bias.data.copy_(b)
    return lin, w, b


def _check_gemm(lin: Linear, w: torch.Tensor, b: torch.Tensor, seed: int) -> None:
    """2-d and 3-d calls of both kinds (decode- and prefill-sized rows) equal the exact product rounded to
    bf16, up to summation order."""
    g = torch.Generator().manual_seed(seed)
    for rows in (1, 5, LARGE_FROM - 1, LARGE_FROM, 300):
        x = torch.randn(rows, w.shape[1], generator=g).bfloat16()
        y = lin(x)
        exact = (x.double() @ w.double().T + b.double()).to(torch.bfloat16)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, w.shape[0])
        torch.testing.assert_close(y.float(), exact.float(), atol=2e-2, rtol=1e-2)
        assert torch.equal(lin(x.view(1, rows, -1)), y.view(1, rows, -1))


# The compiled dot kernel is the avx512_bf16 level of the linear paths; the others run on every x86-64 CPU
# (oneDNN's bf16 packing where oneDNN says so).
PATH_PARAMS = [level_param("avx512_bf16", name, name) if name == "bf16_dot" else name for name in linear_paths.PATHS]


@pytest.fixture()
def path(request) -> str:
    """A linear path, or a skip where this CPU (under the caps) lacks what it needs (the dot kernel must then be
    kept out: it would stop the process on an unknown instruction)."""
    name = request.param
    if name == "bf16_dot" and not runs("avx512_bf16"):
        assert name not in linear_paths.available()
        require("avx512_bf16")
    if name == "onednn_bf16" and not linear_paths._onednn_packs_bf16():
        onednn = os.environ.get(cpu_isa.ONEDNN_ENV, "").strip()
        under = f" under {cpu_isa.ONEDNN_ENV}={onednn}" if onednn else ""
        pytest.skip(f"onednn_bf16 needs avx512bw (or avx_ne_convert); oneDNN on this CPU ({cpu_isa.model_name()})"
                    f"{under} does not pack bf16 weights")
    return name


@pytest.mark.parametrize("path", PATH_PARAMS, indirect=True)
def test_every_path_is_a_bf16_gemm(fresh, monkeypatch, path):
    """PDSERVE_LINEAR=PATH wins over the measurement: the layer packs for that path alone (the plain weight
    dropped) and its calls are a bf16 GEMM's."""
    assert path in linear_paths.available()  # where the CPU has what the path needs, it runs
    monkeypatch.setenv(linear_choice.ENV, path)
    lin, w, b = _layer(1)
    lin.pack()
    assert lin.small.name == lin.large.name == path and lin.large_state is lin.small_state and lin.weight is None
    _check_gemm(lin, w, b, 2)


def test_a_path_that_cannot_run_is_a_start_up_error(fresh, monkeypatch):
    """PDSERVE_LINEAR naming a path this process cannot run (here the compiled kernels, kept out by
    PDSERVE_KERNELS=torch) fails the layer's pack with the paths that can."""
    monkeypatch.setenv("PDSERVE_KERNELS", "torch")
    monkeypatch.setenv(linear_choice.ENV, "bf16_widen")
    with pytest.raises(ValueError, match=r"bf16_widen cannot run here \(available: onednn_"):
        _layer(1)[0].pack()


@pytest.fixture()
def amx() -> None:
    """A skip where this CPU (under the caps) has no AMX, or where oneDNN's own cap keeps it below AMX
    (PDSERVE_CPU_ISA=native leaves ONEDNN_MAX_CPU_ISA to oneDNN alone)."""
    require("amx")
    onednn = os.environ.get(cpu_isa.ONEDNN_ENV, "").strip().upper()
    if onednn and "AMX" not in onednn and onednn not in ("ALL", "DEFAULT"):
        pytest.skip(f"amx needs amx_tile; oneDNN under {cpu_isa.ONEDNN_ENV}={onednn} does not use it")


@pytest.mark.kernel_level("amx")
def test_onednn_bf16_runs_on_amx_where_the_cpu_has_it(fresh, monkeypatch, capfd, amx):
    """No pdserve source has an AMX path: on a CPU with AMX, the onednn_bf16 linear path is where AMX runs
    (oneDNN's bf16 GEMM on tiles). oneDNN's verbose mode names each call's implementation: AMX for decode- and
    prefill-sized calls, and their results are a bf16 GEMM's."""
    monkeypatch.setenv(linear_choice.ENV, "onednn_bf16")
    lin, w, b = _layer(11)
    lin.pack()
    capfd.readouterr()
    with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
        _check_gemm(lin, w, b, 12)
    # onednn_verbose,v1,primitive,exec,cpu,inner_product,<implementation>,...: one line per call
    calls = [line.split(",") for line in capfd.readouterr().out.splitlines() if line.startswith("onednn_verbose,")]
    impls = [fields[6] for fields in calls if fields[2:5] == ["primitive", "exec", "cpu"]]
    assert len(impls) >= 10 and all("amx" in impl for impl in impls), impls


def test_two_paths_in_one_layer(fresh, monkeypatch):
    """PDSERVE_LINEAR=SMALL,LARGE: decode-sized calls take the first path, prefill-sized ones the second,
    each from its own layout."""
    paths = linear_paths.available()
    assert len(paths) >= 2, "oneDNN's fp32 GEMM and the widening kernel run on every x86-64 CPU"
    monkeypatch.setenv(linear_choice.ENV, f"{paths[-1]},{paths[0]}")
    lin, w, b = _layer(3)
    lin.pack()
    assert (lin.small.name, lin.large.name) == (paths[-1], paths[0]) and lin.small_state is not lin.large_state
    _check_gemm(lin, w, b, 4)


def test_bad_override_is_one_clear_error(fresh, monkeypatch):
    monkeypatch.setenv(linear_choice.ENV, "mkl")
    with pytest.raises(ValueError, match="PDSERVE_LINEAR='mkl': expected auto, PATH or SMALL,LARGE"):
        _layer(5)[0].pack()


def test_torch_kernels_keep_the_reference_path(fresh, monkeypatch):
    """PDSERVE_KERNELS=torch: no measurement and no compiled kernel; oneDNN's packed bf16 GEMM, or its fp32
    GEMM on an fp32 copy where oneDNN cannot pack bf16."""
    monkeypatch.setenv("PDSERVE_KERNELS", "torch")
    lin, w, b = _layer(6)
    lin.pack()
    assert lin.small.name == lin.large.name == linear_paths.TORCH_PATHS[0 if linear_paths._onednn_packs_bf16()
                                                                        else 1]
    assert not list(fresh.glob("linear-choice-*.json"))
    _check_gemm(lin, w, b, 7)


def test_a_shape_the_first_path_refuses_takes_the_next(fresh, monkeypatch):
    """K = 60 is no multiple of 8, which the widening kernel needs: that layer takes the next path of the
    ranking, the others keep the first."""
    monkeypatch.setenv(linear_choice.ENV, "bf16_widen")
    if "bf16_widen" not in linear_paths.available():
        pytest.fail("the widening kernel builds on every machine with a C compiler")
    lin, w, b = _layer(8, n=40, k=60)
    lin.pack()
    assert lin.small.name != "bf16_widen"
    _check_gemm(lin, w, b, 9)


def test_fp32_layers_keep_onednn_fp32():
    """fp32 weights are packed for oneDNN's fp32 GEMM whatever the choice (exactness tests run in fp32)."""
    g = torch.Generator().manual_seed(10)
    lin = Linear(64, 50, True, torch.float32)
    lin.weight.data.copy_(torch.randn(50, 64, generator=g))
    lin.bias.data.copy_(torch.randn(50, generator=g))
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    lin.pack()
    assert lin.small is None and lin.packed is not None
    x = torch.randn(7, 64, generator=g)
    torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, w, b))
