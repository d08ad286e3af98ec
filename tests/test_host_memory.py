"""Huge pages behind the big CPU tensors decode steps stream (kernels/host_memory.py): the KV caches
and the compiled kernels' packed weights get them where the OS allows, and the values are unchanged."""
from __future__ import annotations

import torch

from engine.device import Platform
from kernels.host_memory import HUGE_PAGE_BYTES, advise_huge_pages, huge_empty


def _thp_mode() -> str:
    text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    return text[text.index("[") + 1:text.index("]")]


def _anon_huge_bytes() -> int:
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no AnonHugePages line")


def test_a_big_tensor_is_backed_by_huge_pages_where_the_os_allows():
    before = _anon_huge_bytes()
    t = huge_empty((64 << 20,), torch.uint8)
    t.fill_(7)  # first touch: the pages are made now
    grown = _anon_huge_bytes() - before
    if _thp_mode() == "never":
        assert grown < HUGE_PAGE_BYTES
    else:  # madvise or always: most of the 64 MiB (compaction may still miss a few pages)
        assert grown >= 48 << 20, grown
    assert int(t.sum()) == 7 * (64 << 20)


def test_small_and_unaligned_interiors_are_left_alone():
    assert advise_huge_pages(torch.empty(1000)) == 0  # no 2 MiB-aligned interior
    t = torch.empty(5 * HUGE_PAGE_BYTES, dtype=torch.uint8)
    advised = advise_huge_pages(t)
    assert advised % HUGE_PAGE_BYTES == 0 and 3 * HUGE_PAGE_BYTES <= advised <= 5 * HUGE_PAGE_BYTES


def test_cpu_kv_caches_are_zeroed_huge_page_tensors():
    before = _anon_huge_bytes()
    caches = Platform(torch.device("cpu")).allocate_kv_caches(2, 256, 16, 8, 64, torch.bfloat16)
    assert [tuple(c.shape) for c in caches] == [(2, 256, 16, 8, 64)] * 2
    assert all(c.dtype == torch.bfloat16 and not c.any() for c in caches)
    if _thp_mode() != "never":  # 2 x 8 MiB, zeroed (touched) after the advice
        assert _anon_huge_bytes() - before >= 8 << 20
