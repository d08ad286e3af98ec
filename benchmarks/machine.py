"""One line saying which machine a benchmark ran on: every figure is quoted with it.

The same ratios differ between machine kinds (a CPU with AMX or avx512_bf16 runs bfloat16
matmuls natively, an AVX2-only one does not), so each benchmark prints this first.
"""
from __future__ import annotations

import os

import torch

from pdserve.common import cpu_isa


def describe() -> str:
    """lscpu's model name, the flags that decide kernels (and a PDSERVE_CPU_ISA cap if any), torch's threads and
    ISA, and the load average: a figure measured beside a busy neighbour says so."""
    cpu = torch.backends.cpu.get_cpu_capability()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"machine: {cpu_isa.describe()}, {os.cpu_count()} CPUs, torch {torch.__version__} with "
            f"{torch.get_num_threads()} threads, ISA {cpu}; load average {load}")
