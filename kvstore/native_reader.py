"""A KV load's file reads, redis receives and checksums, one layer's objects per call, in C (kvstore/csrc/).

Per object the Python path pays about as much in interpreter work (an open, a stat, a readv of
some 30 block pieces, some 30 hash updates, under the GIL) as the kernel pays copying its half
megabyte; the library does the syscalls, the xxh3 passes and the header compares of a whole
layer in one call with the GIL released, so the store's I/O threads really run side by side.
kvstore/fs_read.py reads with it (`FileSystemStore.span_reader`). Redis loads receive a layer's GET
replies with it (`RedisStore.span_reader`: kv_recv.c, framing, receives into the spans and hashing in
one call, through the load's write gate). A store takes `native_reader()` at its first load: None
under PDSERVE_KERNELS=torch or where the library cannot be had (common/native_build.py's one rule),
and then the Python paths do the same work.

The object format's numbers are codec's (HEADER_SIZE, SUMMED) and the gate's result is ABANDONED
here: each library's init receives them, so the C sources write none of them down.
"""
from __future__ import annotations

import ctypes
import errno
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from pdserve.common.native_build import build_or_none, load_library
from pdserve.kvstore.object_format import HEADER_SIZE, SUMMED
from pdserve.kvstore.spans import SpanReader

SOURCE = Path(__file__).with_name("csrc") / "kv_read.c"
RECV_SOURCE = SOURCE.with_name("kv_recv.c")
ABANDONED = 1  # a call's result (Loaded.status, Replies.status): the gate was closed, nothing more was written
_ptr, _int, _i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
_ERROR_TEXT = 512  # bytes kept of a redis error reply
# Reply bytes a redis load keeps requested ahead of its reader, per connection (kv_recv.c: more costs
# redis-server fresh pages for its reply buffers on every load; less leaves it idle between replies).
WINDOW_BYTES = 1 << 20


@dataclass
class Loaded:
    """What pd_kv_load did with one layer's objects. status 0: read; fds[i] == -1 means object i
    is in its spans, checked; fds[i] >= 0 is its descriptor, left open for the caller to finish it
    (got[i] bytes of it were read, or -errno). -ENOENT: an object is missing (sizes[i] == -1, fds[i]
    its -errno) or of another size (sizes[i]), nothing was read. ABANDONED: the gate was closed,
    nothing was read. Every descriptor not in fds is closed."""

    status: int
    fds: np.ndarray
    sizes: np.ndarray
    got: np.ndarray
    digests: np.ndarray

    @property
    def abandoned(self) -> bool:
        return self.status == ABANDONED


@dataclass
class Replies:
    """What pd_resp_get read: status 0, ABANDONED (the gate closed) or -errno; per object its value's size
    (-1: no such key, -2: an error reply), and its digest when it was read into its spans."""

    status: int
    sizes: np.ndarray
    digests: np.ndarray
    error: str | None  # the first error reply's text
    extra: int  # bytes read past the last reply (0: the stream is clean)

    @property
    def abandoned(self) -> bool:
        return self.status == ABANDONED


class KVReadLibrary:
    """The compiled reader; construct once per process (it builds or loads the library)."""

    def __init__(self, build_dir: Path | None = None) -> None:
        lib = load_library(SOURCE, build_dir)
        xxh = ctypes.CDLL(xxhash._xxhash.__file__)  # noqa: SLF001 (the module's own XXH3, already loaded)
        # XXH3_64bits_update_dispatch picks the widest vector unit this CPU has (AVX2 here: about twice
        # XXH3_64bits_update's speed, the same digest); a build without it has the plain one.
        update = "XXH3_64bits_update_dispatch" if hasattr(xxh, "XXH3_64bits_update_dispatch") else \
            "XXH3_64bits_update"
        addresses = [ctypes.cast(getattr(xxh, name), _ptr).value for name in
                     ("XXH3_createState", "XXH3_freeState", "XXH3_64bits_reset", update, "XXH3_64bits_digest")]
        recv = load_library(RECV_SOURCE, build_dir)
        for init in (lib.pd_kv_init, recv.pd_recv_init):
            init.argtypes = [_ptr] * 5 + [_i64, _i64, _int]
            if init(*addresses, HEADER_SIZE, SUMMED, ABANDONED):
                raise ValueError(f"{init.__name__}: the native readers take no object format with a "
                                 f"{HEADER_SIZE}-byte header of which {SUMMED} bytes are checksummed")
        self._resp_get = recv.pd_resp_get
        self._resp_get.argtypes = [_int, _int, ctypes.c_char_p, _ptr, ctypes.c_int64, _ptr, _ptr, _ptr, _ptr, _ptr,
                                   _ptr, _ptr, _int, _ptr, _int, _ptr, _int]
        self._resp_get.restype = _int
        self._gate_close = recv.pd_gate_close
        self._gate_close.argtypes = [_ptr]
        self._gate_close.restype = ctypes.c_int64
        self._load = lib.pd_kv_load
        self._load.argtypes = [_int, ctypes.c_char_p, _ptr, _ptr, _ptr, _ptr, ctypes.c_char_p, _ptr, _ptr, _ptr, _ptr,
                               _ptr]
        self._load.restype = _int
        self._rows_plan = lib.pd_rows_plan
        self._rows_plan.argtypes = [ctypes.c_int64, _ptr, ctypes.c_int64, ctypes.c_int64, _ptr, ctypes.c_int64,
                                    ctypes.c_int64, _ptr, ctypes.c_int64, _ptr]
        self._rows_plan.restype = ctypes.c_int64
        self._hash = lib.pd_kv_hash
        self._hash.argtypes = [_int, _ptr, _ptr, _ptr, _ptr, _ptr]
        self._hash.restype = _int

    def load(self, paths: list[str], desc: np.ndarray, first: np.ndarray, bases: np.ndarray, headers: np.ndarray,
             expect: bytes, gate: int) -> Loaded:
        """One layer's objects (kvstore/csrc/kv_read.c, pd_kv_load): each opened and its size checked, read
        from the page cache only (never waiting for the medium) into its header (HEADER_SIZE bytes at
        headers[HEADER_SIZE * i]) and its spans, written only inside the gate whose words are at `gate`
        (0: none), hashed, and its header bytes [0, SUMMED) compared with expect[SUMMED * i:SUMMED * (i + 1)]
        and its digest with the one it carries. An object that is not plainly right is left open for the
        caller (Loaded)."""
        n = len(paths)
        if len(expect) != SUMMED * n:
            raise ValueError(f"{len(expect)} expected header bytes for {n} objects")
        out = np.empty((3, n), np.int64)
        digests = np.zeros(n, np.uint64)
        status = self._load(n, os.fsencode("\0".join(paths)) + b"\0", desc.ctypes.data, first.ctypes.data,
                            bases.ctypes.data, headers.ctypes.data, expect, gate or None, out[0].ctypes.data,
                            out[1].ctypes.data, out[2].ctypes.data, digests.ctypes.data)
        if status == -errno.ENOMEM:
            raise MemoryError("no xxh3 state could be allocated")
        return Loaded(status, out[0], out[1], out[2], digests)

    def rows_plan(self, slots: np.ndarray, chunk_lens: list[int], lo: int, hi: int, row_bytes: int,
                  half_bytes: int) -> tuple[np.ndarray, np.ndarray]:
        """(desc, first) of connectors/direct_rows.DirectRows.plan, computed in C (kv_read.c, pd_rows_plan).
        slots: int64, the slot of each row in [lo, hi)."""
        lens = np.asarray(chunk_lens, np.int64)
        if lo < 0 or hi < lo or hi > int(lens.sum()) or len(slots) != hi - lo or slots.dtype != np.int64 or \
                not slots.flags.c_contiguous:
            raise ValueError(f"rows [{lo}, {hi}) of {int(lens.sum())} with {len(slots)} int64 slots")
        cap = 2 * (hi - lo + 2 * len(lens))  # per chunk at most 2 scratch pieces and a piece per cache row, twice
        desc, first = np.empty((cap, 3), np.int64), np.empty(len(lens) + 1, np.int64)
        n = self._rows_plan(len(lens), lens.ctypes.data, lo, hi, slots.ctypes.data, row_bytes, half_bytes,
                            desc.ctypes.data, cap, first.ctypes.data)
        if n < 0:
            raise AssertionError("pd_rows_plan: more pieces than rows")
        return desc[:n], first

    def hash(self, desc: np.ndarray, first: np.ndarray, bases: np.ndarray, headers: np.ndarray) -> np.ndarray:
        """digests[i]: the xxh3 of header i's bytes [0, SUMMED) and object i's spans (already filled)."""
        n = len(first) - 1
        digests = np.empty(n, np.uint64)
        if self._hash(n, desc.ctypes.data, first.ctypes.data, bases.ctypes.data, headers.ctypes.data,
                      digests.ctypes.data):
            raise MemoryError("no xxh3 state could be allocated")
        return digests

    def resp_get(self, fd: int, commands: list[bytes], desc: np.ndarray, first: np.ndarray, bases: np.ndarray,
                 headers: np.ndarray, gate: int, timeout_ms: int, window: int = WINDOW_BYTES, hash: bool = True
                 ) -> Replies:
        """Send `commands` (packed GETs, one per object) on socket `fd` as their replies come in, at most
        `window` expected reply bytes ahead, and read the replies: object i's value, if it is HEADER_SIZE
        bytes plus its spans, lands in its header (at headers[HEADER_SIZE * i]) and its spans (written only
        inside the gate whose words are at address `gate`, 0: none) and is hashed. Each wait for redis lasts at most
        timeout_ms (-1: no limit) with no progress. hash=False: no digests (a raw read, for benchmarks)."""
        n = len(first) - 1
        if len(commands) != n:
            raise ValueError(f"{len(commands)} commands for {n} objects")
        sizes, digests, extra = np.empty(n, np.int64), np.zeros(n, np.uint64), np.zeros(1, np.int64)
        ends = np.cumsum([len(c) for c in commands], dtype=np.int64)
        error = ctypes.create_string_buffer(_ERROR_TEXT)
        status = self._resp_get(fd, n, b"".join(commands), ends.ctypes.data, window, desc.ctypes.data,
                                first.ctypes.data, bases.ctypes.data, headers.ctypes.data, sizes.ctypes.data,
                                digests.ctypes.data, gate or None, timeout_ms, error, _ERROR_TEXT, extra.ctypes.data,
                                int(hash))
        text = error.value.decode(errors="replace") if (sizes == -2).any() and not status else None
        return Replies(status, sizes, digests, text, int(extra[0]))

    def gate_close(self, gate: int) -> int:
        """Shut the gate whose words are at `gate`; the compiled writers still inside (wait for 0)."""
        return self._gate_close(gate)


def native_reader() -> KVReadLibrary | None:
    """This process's compiled reader, or None (PDSERVE_KERNELS=torch, or no library: one warning)."""
    return build_or_none("compiled KV reader", KVReadLibrary, "KV loads read and check objects in Python")


class ReaderSlot:
    """A store's compiled reader of loads into spans: this process's (native_reader), taken at the first load
    that asks; None: the Python paths (PDSERVE_KERNELS=torch, or no library here). Tests and benchmarks set
    another (store.span_reader) to choose a path."""

    def __init__(self) -> None:
        self._chosen = False
        self._reader: SpanReader | None = None

    def get(self) -> SpanReader | None:
        if not self._chosen:
            self.set(native_reader())
        return self._reader

    def set(self, reader: SpanReader | None) -> None:
        self._reader, self._chosen = reader, True
