"""One line saying which machine a benchmark ran on: every figure is quoted with it.

The same ratios differ between machine kinds (a CPU with AMX or avx512_bf16 runs bfloat16
matmuls natively, an AVX2-only one does not), so each benchmark prints this first.
"""
from __future__ import annotations

import os

import torch


def cpu_model() -> str:
    """The CPU's model name as `lscpu` prints it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def describe() -> str:
    cpu = torch.backends.cpu.get_cpu_capability()
    bf16 = ("AMX" if torch.cpu._is_amx_tile_supported()
            else "avx512_bf16" if torch.cpu._is_avx512_bf16_supported() else "no native bf16 matmul")
    return (f"machine: {cpu_model()}, {os.cpu_count()} CPUs, torch {torch.__version__} with "
            f"{torch.get_num_threads()} threads, ISA {cpu} ({bf16})")
