"""Stored KV codecs: how a [2, n, H, D] KV tensor's payload is encoded in a store object.

A store picks its codec with the URL parameter `codec=` (kvstore/__init__.py); every object's header
records the one it was written with (kvstore/object_format.py, byte 7), so a reader needs no configuration and
a store holding objects of several codecs reads them all.

- `raw` (default): the tensor's bytes; the only codec loads read straight into paged memory.
- `lossless`: the tensor's bytes split into byte planes (every element's byte 0, then every byte 1, ...:
  a bf16 KV's exponent-carrying high bytes compress well, its low bytes hardly), zstd level 1. Exact.
- `int8` / `fp8` (e4m3): 8-bit per-token-group quantization, one group per (K or V, token, head) of
  head_dim values, its float32 scale absmax/127 (int8) or absmax/448 (e4m3). Payload: the scales
  [2, n, H] then the codes [2, n, H, D]; both under the object's checksum. Lossy, opt-in, measured
  (docs/benchmarks.md), never asserted equal.

Everything here runs on a store's I/O threads (encode in the save's background put, decode in the
load), in numpy (single-threaded by construction), in torch slices below its parallel grain (the e4m3
conversion), and in plain C (the 8-bit decode, kvstore/csrc/kv_dequant.c; the torch multiply where there is
no library): an I/O thread never starts an OpenMP team of its own (docs/architecture.md, "One OpenMP team").
"""
from __future__ import annotations

import ctypes
import functools
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pdserve.common.native_build import build_or_none, load_library

RAW, LOSSLESS, INT8, FP8 = "raw", "lossless", "int8", "fp8"
CODES = {RAW: 0, LOSSLESS: 1, INT8: 2, FP8: 3}  # the header's byte 7
NAMES = {code: name for name, code in CODES.items()}
_QMAX = {INT8: 127.0, FP8: 448.0}
_ZSTD_LEVEL = 1  # level 3 gained little ratio on SmolLM2's KV for several times the encode time
_local = threading.local()
_GRAIN = 32768  # torch's internal::GRAIN_SIZE: an elementwise op on fewer elements runs on the calling thread


def check_name(name: str) -> str:
    if name not in CODES:
        raise ValueError(f"unknown KV codec {name!r}; known: {', '.join(CODES)}")
    return name


def encode(tensor: torch.Tensor, name: str) -> bytes:
    """The payload of a contiguous CPU tensor [2, n, H, D] under codec `name` (not raw)."""
    if name == LOSSLESS:
        raw = tensor.reshape(-1).view(torch.uint8).numpy().reshape(-1, tensor.element_size())
        return _compressor().compress(np.ascontiguousarray(raw.T).tobytes())
    qmax = _QMAX[name]
    x = _as_float32(tensor)  # [2, n, H, D]
    absmax = np.abs(x).max(axis=-1, keepdims=True) if x.size else np.zeros((*x.shape[:-1], 1), np.float32)
    scales = np.where(absmax > 0, absmax / qmax, np.float32(1.0)).astype(np.float32)
    y = x / scales
    if name == INT8:
        codes = np.clip(np.rint(y), -127, 127).astype(np.int8).view(np.uint8)
    else:
        codes = _to_e4m3(y)
    return scales.tobytes() + codes.tobytes()


def decode(payload: memoryview, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A fresh tensor of `dtype` and `shape` from a payload of codec `name` (not raw); ValueError when the
    payload does not decode to that shape."""
    count = int(np.prod(shape))
    itemsize = torch.empty((), dtype=dtype).element_size()
    if name == LOSSLESS:
        planes = _decompressor().decompress(bytes(payload), max_output_size=count * itemsize)
        if len(planes) != count * itemsize:
            raise ValueError(f"{len(planes)} decompressed bytes, expected {count * itemsize}")
        raw = np.frombuffer(planes, np.uint8).reshape(itemsize, count).T.copy()
        return torch.from_numpy(raw.reshape(-1)).view(dtype).view(shape)
    groups = count // shape[-1] if shape[-1] else 0
    if payload.nbytes != 4 * groups + count:
        raise ValueError(f"{payload.nbytes} payload bytes, expected {4 * groups + count} for {list(shape)}")
    scales = torch.frombuffer(payload, dtype=torch.float32, count=groups).view(*shape[:-1], 1)
    # int8 codes go to the multiply as they are; e4m3 ones through a table (torch's own float8 -> float
    # conversion is ~15x slower on CPU)
    out = torch.empty(shape, dtype=dtype)
    lib = _dequant_library()
    if lib is not None and count:  # one pass in C: ~5x the torch path's speed (docs/benchmarks.md)
        codes = np.frombuffer(payload, np.uint8, count, offset=4 * groups)
        table = _E4M3.ctypes.data if name == FP8 else None
        if lib.pd_dequant(groups, shape[-1], codes.ctypes.data, scales.data_ptr(), table, out.data_ptr(),
                          _DTYPE_CODES[dtype]) == 0:
            return out
    if name == INT8:
        values = torch.frombuffer(payload, dtype=torch.int8, count=count, offset=4 * groups)
    else:
        values = torch.from_numpy(_E4M3[np.frombuffer(payload, np.uint8, count, offset=4 * groups)])
    rows = max(1, _GRAIN // max(1, shape[-1]))  # one multiply per slice below torch's parallel grain
    flat_out, flat_values, flat_scales = out.view(-1, shape[-1]), values.view(-1, shape[-1]), scales.view(-1, 1)
    for start in range(0, flat_out.shape[0], rows):
        torch.mul(flat_values[start:start + rows], flat_scales[start:start + rows], out=flat_out[start:start + rows])
    return out


def payload_bytes(name: str, count: int, dim: int, itemsize: int) -> int | None:
    """The payload size of `count` values under codec `name`; None where it depends on the values (lossless)."""
    if name == LOSSLESS:
        return None
    return count * itemsize if name == RAW else 4 * (count // dim if dim else 0) + count


def layer_source(payload: memoryview, name: str, count: int, dim: int, itemsize: int) -> memoryview:
    """What decode_spans reads of one object's payload under codec `name`: the payload itself (raw, 8-bit:
    its size checked) or its byte planes decompressed (lossless: zstd is per object by nature). ValueError
    when the payload cannot hold `count` values."""
    if name == LOSSLESS:
        planes = _decompressor().decompress(bytes(payload), max_output_size=count * itemsize)
        if len(planes) != count * itemsize:
            raise ValueError(f"{len(planes)} decompressed bytes, expected {count * itemsize}")
        return memoryview(planes)
    want = payload_bytes(name, count, dim, itemsize)
    if payload.nbytes != want or (name != RAW and dim and count % dim):
        raise ValueError(f"{payload.nbytes} payload bytes, expected {want} for {count} values")
    return payload


def decode_spans(names: list[str], sources: list[memoryview], counts: list[int], dim: int, dtype: torch.dtype,
                 desc: np.ndarray, first: np.ndarray, bases: np.ndarray, views: Any) -> None:
    """Object i (codec names[i], its layer_source sources[i], counts[i] values of `dtype`) decoded into its
    pieces desc[first[i]:first[i + 1]] of a span table (kvstore/spans.py), in order, as its raw payload would
    fill them: a whole layer in one call of kvstore/csrc/kv_dequant.c (pd_decode_spans, the GIL released).
    Without the library, object by object through decode() into `views()` (the table's memoryviews)."""
    lib = _dequant_library()
    if lib is not None and dtype in _DTYPE_CODES and len(names):
        # every array C reads is held by a name until it returns (a temporary's address dangles at once)
        keep = [np.frombuffer(src, np.uint8) for src in sources]
        codes = np.array([CODES[n] for n in names], np.int64)
        addresses = np.array([a.ctypes.data for a in keep], np.uint64)
        values = np.array(counts, np.int64)
        status = lib.pd_decode_spans(len(names), codes.ctypes.data, addresses.ctypes.data, values.ctypes.data, dim,
                                     desc.ctypes.data, first.ctypes.data, bases.ctypes.data, _E4M3.ctypes.data,
                                     _DTYPE_CODES[dtype])
        if status == 0:
            return
        if status == -2:
            raise ValueError("the span table does not hold the objects' values")
    itemsize = dtype.itemsize
    for name, src, count, spans in zip(names, sources, counts, views()):
        if name == RAW:
            data = src
        elif name == LOSSLESS:
            data = memoryview(np.frombuffer(src, np.uint8).reshape(itemsize, count).T.copy()).cast("B")
        else:
            data = memoryview(decode(src, name, dtype, (count // dim, dim)).reshape(-1).view(torch.uint8).numpy())
        offset = 0
        for span in spans:
            span[:] = data[offset:offset + span.nbytes]
            offset += span.nbytes


def _as_float32(tensor: torch.Tensor) -> np.ndarray:
    if tensor.dtype == torch.float32:
        return tensor.numpy()
    if tensor.dtype == torch.bfloat16:
        return (tensor.view(torch.int16).numpy().view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if tensor.dtype == torch.float16:
        return tensor.view(torch.int16).numpy().view(np.float16).astype(np.float32)
    raise ValueError(f"no 8-bit codec for {tensor.dtype} KV")


_DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}  # kv_dequant.c's out_code


def _dequant_library() -> Any:
    """kvstore/csrc/kv_dequant.c, or None (PDSERVE_KERNELS=torch, or no library: the torch multiply)."""
    return build_or_none("compiled KV dequantize", _load_dequant, "8-bit KV decodes with a torch multiply")


def _load_dequant() -> Any:
    lib = load_library(Path(__file__).with_name("csrc") / "kv_dequant.c")
    lib.pd_dequant.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                               ctypes.c_void_p, ctypes.c_int]
    lib.pd_dequant.restype = ctypes.c_int
    lib.pd_decode_spans.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.pd_decode_spans.restype = ctypes.c_int
    return lib


@functools.cache
def _e4m3_table() -> np.ndarray:
    """The value of each of the 256 e4m3 codes (the two NaN codes as 0: quantized codes are never NaN)."""
    return np.nan_to_num(torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy())


_E4M3 = _e4m3_table()


def _to_e4m3(y: np.ndarray) -> np.ndarray:
    """e4m3 codes of values within [-448, 448] (torch's conversion: round to nearest even), in slices below
    torch's parallel grain, so the conversion never starts an OpenMP team on an I/O thread."""
    flat = torch.from_numpy(np.ascontiguousarray(y, np.float32).reshape(-1))
    out = torch.empty(flat.numel(), dtype=torch.float8_e4m3fn)
    for start in range(0, flat.numel(), _GRAIN):
        out[start:start + _GRAIN] = flat[start:start + _GRAIN]
    return out.view(torch.uint8).numpy().reshape(y.shape)


def _compressor():
    found = getattr(_local, "compressor", None)
    if found is None:
        import zstandard

        found = _local.compressor = zstandard.ZstdCompressor(level=_ZSTD_LEVEL)
    return found


def _decompressor():
    found = getattr(_local, "decompressor", None)
    if found is None:
        import zstandard

        found = _local.decompressor = zstandard.ZstdDecompressor()
    return found
