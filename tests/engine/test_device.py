"""The device choice, the attention backend choice, KV sizing arithmetic and the CPU engine end to end.

Everything CUDA-only (pinned memory, streams, profiling a forward) runs in tests_gpu/; here the
same code paths run with the CPU platform, where they are synchronous no-ops.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pdserve.serving import LLM, SamplingParams
from pdserve.engine.attention import backend_name, select_attention_backend
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.device import NullEvent, Platform, resolve_device
from pdserve.engine.kv_cache_sizing import GIB, GpuMemoryProfile, fixed_budget
from pdserve.kernels import ops
from tests.helpers.connector import hf_greedy, prompt

CPU = torch.device("cpu")


def test_resolve_device_on_a_machine_without_cuda():
    assert not torch.cuda.is_available()  # this suite is the CPU CI; tests_gpu/ covers CUDA
    assert resolve_device("auto") == CPU and resolve_device("cpu") == CPU
    for spec in ("cuda", "cuda:0"):
        with pytest.raises(ValueError, match="sees no CUDA device.*--device cpu"):
            resolve_device(spec)
    with pytest.raises(ValueError, match="auto, cpu, cuda or cuda:N"):
        resolve_device("gpu")


@pytest.mark.parametrize("bad", ["gpu", "cuda:", "cuda:x", "CPU", "mps", ""])
def test_config_rejects_bad_device_and_backend(bad):
    with pytest.raises(ValueError, match="device must be auto, cpu, cuda or cuda:N"):
        EngineConfig.from_kwargs("m", device=bad)
    with pytest.raises(ValueError, match="attention_backend must be one of auto, torch, cpu, triton"):
        EngineConfig.from_kwargs("m", attention_backend=bad or "flash")


@pytest.mark.slow  # seconds: outside make test-quick
def test_cli_rejects_bad_device_in_milliseconds():
    proc = subprocess.run([sys.executable, "-m", "pdserve.serving.server", "--device", "gpu"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "expected auto, cpu, cuda or cuda:N, got 'gpu'" in proc.stderr


def test_attention_backend_chosen_from_the_device(monkeypatch):
    monkeypatch.delenv("PDSERVE_KERNELS", raising=False)
    assert backend_name(CPU) == "cpu"
    assert backend_name(torch.device("cuda", 0)) == "triton"
    assert backend_name(CPU, "torch") == "torch"
    with ops.use_backend("torch"):  # the tests' oracle runs force the torch reference
        assert backend_name(CPU) == "torch"
    with pytest.raises(ValueError, match="runs on CPU tensors only"):
        backend_name(torch.device("cuda", 0), "cpu")
    assert backend_name(CPU, "triton") == "triton"  # conftest set TRITON_INTERPRET=1: the interpreter
    assert select_attention_backend(CPU).name == "cpu"
    assert select_attention_backend(CPU, "torch").name == "torch"
    assert select_attention_backend(CPU, "triton").name == "triton"
    monkeypatch.setenv("PDSERVE_KERNELS", "triton")  # the kernels' env override applies to `auto` too
    assert backend_name(CPU) == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="only in Triton's interpreter"):
        backend_name(CPU, "triton")


def test_cpu_platform_degrades_to_synchronous_no_ops():
    p = Platform(CPU)
    assert not p.is_cuda and p.describe() == "cpu"
    assert p.new_stream() is None and p.current_stream() is None
    event = p.new_event()
    assert isinstance(event, NullEvent) and event.query()
    event.record(), event.synchronize(), p.wait_event(event), p.wait_stream(None), p.synchronize()
    with p.stream(p.new_stream()):
        pinned = p.pinned_empty((3, 4), torch.float16)
    assert pinned.shape == (3, 4) and not pinned.is_pinned()
    buf = p.host_device_buffer(8, torch.int32)
    buf.host[:3] = torch.tensor([1, 2, 3], dtype=torch.int32)
    assert buf.device is buf.host and buf.to_device(3).tolist() == [1, 2, 3]  # CPU: one tensor, no copy
    caches = p.allocate_kv_caches(2, 5, 16, 2, 32, torch.bfloat16)
    assert len(caches) == 2 and caches[0].shape == (2, 5, 16, 2, 32) and caches[1].abs().sum() == 0
    with pytest.raises(ValueError, match="only for CUDA"):
        p.memory_info()


def test_kv_sizing_options():
    assert fixed_budget(CacheConfig(kv_cache_memory="2GiB"), Platform(CPU)) == 2 * GIB
    assert fixed_budget(CacheConfig(), Platform(CPU)) == GIB  # the CPU default
    assert fixed_budget(CacheConfig(), Platform(torch.device("cuda", 0))) is None  # CUDA: profile
    with pytest.raises(ValueError, match="on CPU give kv_cache_memory"):
        fixed_budget(CacheConfig(gpu_memory_utilization=0.5), Platform(CPU))
    with pytest.raises(ValueError, match="not both"):
        CacheConfig(kv_cache_memory="1GiB", gpu_memory_utilization=0.5)
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        CacheConfig(gpu_memory_utilization=1.5)


def test_gpu_memory_utilization_arithmetic():
    profile = GpuMemoryProfile(total=80 * GIB, utilization=0.9, weights=2 * GIB, activations=GIB // 2,
                               non_torch=GIB // 4, free=78 * GIB, profiled="one forward of 2048 tokens in 64 sequences")
    assert profile.kv_budget == int(0.9 * 80 * GIB) - 2 * GIB - GIB // 2 - GIB // 4
    assert profile.describe() == (
        "KV cache memory: 0.90 x 80.00 GiB = 72.00 GiB for this engine - 2.00 GiB weights - 0.50 GiB peak "
        "activations (one forward of 2048 tokens in 64 sequences) - 0.25 GiB outside torch = 69.25 GiB for KV")
    profile.check(torch.device("cuda", 0))
    crowded = GpuMemoryProfile(**{**profile.__dict__, "free": 10 * GIB})
    with pytest.raises(ValueError, match="only 10.00 GiB are free on cuda:0"):
        crowded.check(torch.device("cuda", 0))
    tiny = GpuMemoryProfile(**{**profile.__dict__, "utilization": 0.01})
    with pytest.raises(ValueError, match="nothing is left for the KV cache"):
        tiny.check(torch.device("cuda", 0))


def test_engine_end_to_end_on_device_cpu(tiny_llama, caplog):
    """device='cpu' named explicitly: weights, KV, metadata and sampling on the CPU, outputs equal HF's."""
    prompts = [prompt(n, seed=1) for n in (1, 17, 40)]
    with caplog.at_level("INFO"):
        llm = LLM(str(tiny_llama), device="cpu", kv_cache_memory="8MiB")
    runner = llm.engine.model_runner
    assert runner.device == CPU and runner.attn_backend.name == "cpu"
    assert all(p.device == CPU for p in runner.model.parameters()) and runner.kv_caches[0].device == CPU
    assert "on cpu, attention cpu" in caplog.text
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == hf_greedy(tiny_llama, prompts, max_tokens=6)
