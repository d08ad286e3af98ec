"""Huge pages behind the big CPU tensors decode steps stream (kernels/host_memory.py): the KV caches
and the compiled kernels' packed weights get them where the OS allows, and the values are unchanged."""
from __future__ import annotations

import ctypes
import mmap
import subprocess
import sys

import torch

from pdserve.engine.device import Platform
from pdserve.kernels.host_memory import HUGE_PAGE_BYTES, advise_huge_pages, huge_empty


def _thp_mode() -> str:
    text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    return text[text.index("[") + 1:text.index("]")]


def _huge_bytes_behind(t: torch.Tensor) -> int:
    """AnonHugePages of the mapping that holds `t`'s first 2 MiB-aligned byte (/proc/self/smaps; the
    advice splits the allocation's mapping there)."""
    addr, inside = -(-t.data_ptr() // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {addr:#x}")


def _huge_bytes_at(addr: int) -> int:
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    return 0


def _os_allows(size: int) -> int:
    """Huge-page bytes the OS gives a plain advised mapping of `size` bytes right now (a control: after a long
    run beside other processes, memory may be too fragmented for the kernel to find free 2 MiB pages)."""
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # private: shared memory has no THP
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
        m[:] = b"\x07" * size  # first touch
        first = ctypes.c_char.from_buffer(m)
        addr = ctypes.addressof(first)
        del first  # (an exported buffer would keep the mapping from closing)
        return _huge_bytes_at(addr)
    finally:
        m.close()


def _in_a_fresh_process(test: str) -> None:
    """Run one of this module's checks in a new interpreter: in a long-lived one (the whole suite's) the
    allocator hands back heap already touched in 4 KiB pages, which no advice turns into huge pages, while
    an engine allocates its KV caches and packed weights once, at start-up."""
    code = f"from tests.kernels.test_host_memory import {test} as check; check()"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_big_tensor_is_backed_by_huge_pages_where_the_os_allows():
    _in_a_fresh_process("check_big_tensor")


def test_cpu_kv_caches_are_zeroed_huge_page_tensors():
    _in_a_fresh_process("check_kv_caches")


def check_big_tensor():
    t = huge_empty((64 << 20,), torch.uint8)
    t.fill_(7)  # first touch: the pages are made now
    if _thp_mode() == "never":
        assert _huge_bytes_behind(t) == 0
    else:  # madvise or always: most of the 64 MiB (compaction may still miss a few pages), or, where the OS
        # cannot find that many free huge pages now, no fewer than a plain advised mapping gets beside it
        assert _huge_bytes_behind(t) >= min(48 << 20, _os_allows(64 << 20) - (8 << 20))
    assert int(t.sum()) == 7 * (64 << 20)


def test_small_and_unaligned_interiors_are_left_alone():
    assert advise_huge_pages(torch.empty(1000)) == 0  # no 2 MiB-aligned interior
    t = torch.empty(5 * HUGE_PAGE_BYTES, dtype=torch.uint8)
    advised = advise_huge_pages(t)
    assert advised % HUGE_PAGE_BYTES == 0 and 3 * HUGE_PAGE_BYTES <= advised <= 5 * HUGE_PAGE_BYTES


def check_kv_caches():
    caches = Platform(torch.device("cpu")).allocate_kv_caches(2, 1536, 16, 8, 64, torch.bfloat16)  # 48 MiB each
    assert [tuple(c.shape) for c in caches] == [(2, 1536, 16, 8, 64)] * 2
    assert all(c.dtype == torch.bfloat16 and not c.any() for c in caches)
    if _thp_mode() != "never":  # zeroed (touched) after the advice
        want = min(32 << 20, _os_allows(48 << 20) - (8 << 20))
        assert all(_huge_bytes_behind(c) >= want for c in caches), ([_huge_bytes_behind(c) for c in caches], want)
