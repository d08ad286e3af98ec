"""The CPU kinds this machine stands in for (common/cpu_isa.py): under PDSERVE_CPU_ISA and oneDNN's
ONEDNN_MAX_CPU_ISA, a process compiles its kernels for the capped level, sees only the capped flags,
chooses its linear paths among what runs there, and still computes what HF computes: fp32 logits within
the exactness tolerance of tests/engine/test_models.py, bf16 logits within HF's own bf16 error.

Each kind runs in a process of its own: oneDNN reads its cap once, at its first use. A cap above what
this CPU has changes nothing, so a kind this CPU (or this process's own cap) does not reach skips with a
reason instead of passing as a smaller kind."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.common import cpu_isa
from tests.helpers.kernels import LEVELS, Level, built_level, level_params, require

REPO = Path(__file__).resolve().parents[2]
# Each kind as the two caps that emulate it: pdserve's and oneDNN's.
KINDS = {"avx2": "AVX2", "avx512": "AVX512_CORE_VNNI", "avx512_bf16": "AVX512_CORE_BF16"}
ISA_OF_LEVEL = {"x86-64": "c", "avx2": "avx2", "avx512": "avx512", "avx512_bf16": "avx512_bf16"}

PROBE = """
import json, torch
from pdserve.common import cpu_isa
from pdserve.kernels import linear_paths
from pdserve.kernels.cpu_attention import CpuDecodeAttention
from pdserve.kernels.cpu_prefill_attention import CpuPrefillAttention
from pdserve.kernels.linear_choice import linear_choice
c = linear_choice()
print(json.dumps({"level": cpu_isa.level(), "bf16": cpu_isa.has("avx512_bf16"), "avx512f": cpu_isa.has("avx512f"),
                  "decode_isa": CpuDecodeAttention().isa, "prefill_kernel": CpuPrefillAttention().available,
                  "paths": linear_paths.available(), "small": c.small, "large": c.large}))
"""

CHECKS = """
import sys, tempfile
from pathlib import Path
from tests.engine.test_models import test_bf16_logits_within_tolerance_of_hf
from tests.helpers.model_steps import check_against_hf
from pdserve.engine.builtin_model import make_model
with tempfile.TemporaryDirectory() as tmp:
    check_against_hf(make_model(Path(tmp) / "fp32", arch="llama", num_kv_heads=2))
    test_bf16_logits_within_tolerance_of_hf(Path(tmp) / "bf16", "llama")
print("ok")
"""


def _run(kind: str, code: str, timeout: float) -> str:
    env = {**os.environ, cpu_isa.ENV: kind, cpu_isa.ONEDNN_ENV: KINDS[kind], "PYTHONPATH": str(REPO)
           + os.pathsep + os.environ.get("PYTHONPATH", ""), "HF_HUB_OFFLINE": "1"}
    env.pop("PDSERVE_KERNELS", None)
    env.pop("PDSERVE_LINEAR", None)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


@pytest.fixture()
def level(request) -> Level:
    """The level (a kind's, for the capped processes) a case runs at, or a skip where this CPU lacks it."""
    return require(request.param)


@pytest.mark.slow  # compiles every C source for each level once (then cached)
@pytest.mark.parametrize("level", level_params(*KINDS), indirect=True)
def test_a_capped_process_sees_and_builds_only_its_level(level):
    """The capped level decides the flags the process sees, the decode attention kernel's vector path (its
    build's -march), whether the bf16 dot instruction runs (linear) and the prefill attention kernel
    (AVX-512 on), and which linear paths are measured: oneDNN packs bf16 from AVX-512 on (emulated without
    AVX512_BF16), not below."""
    kind = level.name
    got = json.loads(_run(kind, PROBE, 300))
    assert got["level"] == kind
    assert got["decode_isa"] == ISA_OF_LEVEL[kind]
    dot, avx512 = kind == "avx512_bf16", kind in ("avx512", "avx512_bf16")
    assert got["bf16"] is dot and ("bf16_dot" in got["paths"]) is dot
    assert got["avx512f"] is avx512 and got["prefill_kernel"] is avx512  # the dot's products by FMAs without it
    assert ("onednn_bf16" in got["paths"]) is avx512
    assert {"onednn_fp32", "bf16_widen"} <= set(got["paths"])
    assert set(got["small"]) == set(got["large"]) == set(got["paths"])


@pytest.mark.slow
@pytest.mark.parametrize("level", level_params("avx2", "avx512"), indirect=True)
def test_a_capped_kind_computes_what_hf_computes(level):
    """Under the cap: fp32 logits of chunked prefill and decode steps in mixed batches equal HF's to
    tests/engine/test_models.py's tolerance, and bf16 logits (through the linear paths chosen under the cap)
    are as close to HF's fp32 logits as HF's own bf16 run, with the same greedy tokens wherever HF's top
    two are clearly apart."""
    assert _run(level.name, CHECKS, 600) == "ok"


@pytest.mark.slow
@pytest.mark.parametrize("level", level_params("avx512"), indirect=True)
def test_the_real_model_in_bf16_on_the_xeon_kind(level, smollm2):
    """SmolLM2 in bf16 on the kind where oneDNN's bf16 GEMM is emulated (AVX-512 without AVX512_BF16, the
    issue's Xeon), where the measured choice takes other paths than natively: the logits stay within
    tests/engine/test_real_model.py's tolerance of HF fp32."""
    code = ("from pathlib import Path\n"
            "from tests.engine.test_real_model import test_bf16_logits_are_as_close_to_hf_fp32_as_hf_bf16 as check\n"
            f"check(Path({str(smollm2)!r}))\nprint('ok')")
    assert _run(level.name, code, 600) == "ok"


@pytest.mark.parametrize("level", level_params("avx512", "avx2"), indirect=True)
def test_the_widening_kernel_gives_the_same_bits_at_every_level(level, tmp_path):
    """The fp32-widening bf16 linear kernel built for AVX-512F (one 16-lane accumulator per row, 12-row tiles)
    and for AVX2 (two 8-lane ones, 6-row tiles) adds the same products in the same order as its baseline
    x86-64 build: one kind's figures and another's outputs belong to the same arithmetic. Rows cover every
    tile height of both vector builds and a partial last panel."""
    import torch

    from pdserve.kernels.cpu_linear import SOURCE, Bf16Linear

    plain = LEVELS["c"]
    assert (built_level(SOURCE, level.flags), built_level(SOURCE, plain.flags)) == (level.name, "c")
    kernel, reference = Bf16Linear(tmp_path, level.flags), Bf16Linear(tmp_path, plain.flags)
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(50, 72, generator=g).bfloat16(), torch.randn(50, generator=g).bfloat16()
    packed = Bf16Linear.pack(w, b)
    for rows in (1, 5, 6, 7, 11, 12, 13, 25, 100):
        x = torch.randn(rows, 72, generator=g).bfloat16()
        assert torch.equal(kernel(x, packed), reference(x, packed)), rows


def test_the_cap_is_read_from_either_variable(monkeypatch):
    """PDSERVE_CPU_ISA wins; unset, ONEDNN_MAX_CPU_ISA's level; `native` or a wider oneDNN cap: none; a
    typo is an error, not the wrong kind measured."""
    monkeypatch.delenv(cpu_isa.ENV, raising=False)
    monkeypatch.setenv(cpu_isa.ONEDNN_ENV, "AVX512_CORE_VNNI")
    assert cpu_isa.cap() == "avx512"
    monkeypatch.setenv(cpu_isa.ONEDNN_ENV, "AVX512_CORE_AMX")
    assert cpu_isa.cap() is None
    monkeypatch.setenv(cpu_isa.ENV, "avx2")
    assert cpu_isa.cap() == "avx2" and not cpu_isa.has("avx512f") and not cpu_isa.has("amx_tile")
    monkeypatch.setenv(cpu_isa.ENV, "native")
    assert cpu_isa.cap() is None and cpu_isa.effective_flags() == cpu_isa.cpu_flags()
    monkeypatch.setenv(cpu_isa.ENV, "avx-512")
    with pytest.raises(ValueError, match="PDSERVE_CPU_ISA='avx-512' is not one of native, x86-64, avx2"):
        cpu_isa.cap()


def test_a_cap_hides_the_flags_above_its_level():
    flags = frozenset("sse4_2 avx avx2 fma f16c bmi1 bmi2 movbe abm xsave avx512f avx512bw avx512cd avx512dq "
                      "avx512vl avx512_vnni avx512_bf16 amx_tile amx_bf16".split())
    assert cpu_isa.native_level(flags) == "avx512_bf16"
    assert cpu_isa.hidden_by("avx512_bf16", flags) == {"amx_tile", "amx_bf16"}
    assert cpu_isa.hidden_by("avx512", flags) == {"amx_tile", "amx_bf16", "avx512_bf16"}
    assert cpu_isa.native_level(flags - cpu_isa.hidden_by("avx2", flags)) == "avx2"
    assert cpu_isa.native_level(flags - cpu_isa.hidden_by("x86-64", flags)) == "x86-64"
    assert "sse4_2" not in cpu_isa.hidden_by("x86-64", flags)
