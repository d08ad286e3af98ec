"""The on-store object format: one (chunk, layer) KV tensor as raw bytes behind a 64-byte header.

Layout (little endian):
    0  magic b"PDKV" | 4 version u16 | 6 dtype code u8 | 7 reserved u8
    8  shape [2, n_tokens, num_kv_heads, head_dim] as 4 x u32
    24 model fingerprint (16 bytes) | 40 payload length u64 | 48 xxh3_64 checksum u64
    56 zero padding to 64 (keeps the payload 64-byte aligned inside the object)
    64 payload: the tensor's bytes in C order

The checksum covers header bytes [0, 48) and the payload, so a flipped dtype or shape is
caught as surely as a flipped payload byte. Decoding never unpickles anything: a shared
store is writable by others, and reading it must not execute code.
"""
from __future__ import annotations

import functools
import struct
import warnings
from typing import Sequence

import torch
import xxhash

from kvstore.errors import CorruptObject

MAGIC = b"PDKV"
VERSION = 1
HEADER_SIZE = 64
_HEAD = struct.Struct("<4sHBB4I16sQ")  # magic .. payload length: the checksummed part (48 bytes)
_SUM = struct.Struct("<Q")
# torch warns once per process when a tensor aliases read-only bytes; decode() documents it.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1, torch.float16: 2, torch.bfloat16: 3,
    torch.float8_e4m3fn: 4, torch.float8_e5m2: 5,
}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """Accept torch.bfloat16 or 'bfloat16' / 'torch.bfloat16'."""
    if isinstance(dtype, torch.dtype):
        found = dtype
    else:
        found = getattr(torch, str(dtype).replace("torch.", ""), None)
    if found not in DTYPE_CODES:
        raise ValueError(f"unsupported KV dtype {dtype!r}; supported: {[str(d) for d in DTYPE_CODES]}")
    return found


@functools.lru_cache(maxsize=64)
def fingerprint_bytes(fingerprint: str) -> bytes:
    try:
        raw = bytes.fromhex(fingerprint)
    except (TypeError, ValueError):
        raw = b""
    if len(raw) != 16:
        raise ValueError(f"model fingerprint must be 32 hex digits, got {fingerprint!r}")
    return raw


def encode(tensor: torch.Tensor, fingerprint: str) -> tuple[bytes, memoryview]:
    """(header, payload view) of a [2, n_tokens, kv_heads, head_dim] tensor; the payload is not copied
    for a contiguous CPU tensor, so file writes can go straight from the tensor (os.writev)."""
    if tensor.dim() != 4 or tensor.shape[0] != 2:
        raise ValueError(f"KV layer tensor must be [2, n_tokens, kv_heads, head_dim], got {list(tensor.shape)}")
    code = DTYPE_CODES.get(tensor.dtype)
    if code is None:
        raise ValueError(f"unsupported KV dtype {tensor.dtype}")
    payload = tensor_bytes(tensor.detach().cpu().contiguous())
    head = _HEAD.pack(MAGIC, VERSION, code, 0, *tensor.shape, fingerprint_bytes(fingerprint), payload.nbytes)
    checksum = xxhash.xxh3_64(head)
    checksum.update(payload)
    header = head + _SUM.pack(checksum.intdigest()) + bytes(HEADER_SIZE - _HEAD.size - _SUM.size)
    return header, payload


def encode_bytes(tensor: torch.Tensor, fingerprint: str) -> bytes:
    """The whole object as one contiguous value (what a key-value store needs)."""
    header, payload = encode(tensor, fingerprint)
    return b"".join((header, payload))


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (writable: reads can land in it)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("expected a contiguous CPU tensor")
    return memoryview(tensor.view(-1).view(torch.uint8).numpy())


def decode(buf: bytes | bytearray | memoryview, fingerprint: str, dtype: torch.dtype | None = None,
           kv_shape: Sequence[int] | None = None, name: str = "object") -> torch.Tensor:
    """Validate everything and return the [2, n, H, D] tensor; raises CorruptObject on any mismatch.

    The buffer becomes the tensor's storage without a copy. A read-only one (bytes from
    redis) is aliased too: the result is for reading (scatter into paged memory), never for
    writing — copying it into fresh memory would halve redis read throughput (page faults).
    """
    view = memoryview(buf).cast("B")
    if view.nbytes < HEADER_SIZE:
        raise CorruptObject(f"{name}: {view.nbytes} bytes is shorter than the {HEADER_SIZE}-byte header")
    found, shape = _check(view[:HEADER_SIZE], view[HEADER_SIZE:], fingerprint, dtype, kv_shape, name)
    if view.nbytes == HEADER_SIZE:
        return torch.empty(shape, dtype=found)
    return torch.frombuffer(view, dtype=found, offset=HEADER_SIZE).view(shape)


def decode_into(header: bytes | bytearray | memoryview, out: torch.Tensor, payload: memoryview, fingerprint: str,
                name: str = "object") -> None:
    """Validate an object whose payload was already read into `out` (a preallocated tensor of the
    expected dtype and shape; `payload` is tensor_bytes(out)); CorruptObject if the header
    disagrees with `out` or the checksum fails."""
    view = memoryview(header).cast("B")
    if view.nbytes < HEADER_SIZE:
        raise CorruptObject(f"{name}: {view.nbytes} bytes is shorter than the {HEADER_SIZE}-byte header")
    _, shape = _check(view[:HEADER_SIZE], payload, fingerprint, out.dtype, out.shape[2:], name)
    if shape != tuple(out.shape):
        raise CorruptObject(f"{name}: shape {list(shape)}, expected {list(out.shape)}")


def _check(header: memoryview, payload: memoryview, fingerprint: str, dtype: torch.dtype | None,
           kv_shape: Sequence[int] | None, name: str) -> tuple[torch.dtype, tuple[int, int, int, int]]:
    """Validate header fields against the expectations and the checksum over header + payload."""
    magic, version, code, _, two, n_tokens, heads, head_dim, fp, length = _HEAD.unpack_from(header)
    if magic != MAGIC:
        raise CorruptObject(f"{name}: bad magic {magic!r}")
    if version != VERSION:
        raise CorruptObject(f"{name}: format version {version}, this reader knows {VERSION}")
    found = CODE_DTYPES.get(code)
    if found is None:
        raise CorruptObject(f"{name}: unknown dtype code {code}")
    if fp != fingerprint_bytes(fingerprint):
        raise CorruptObject(f"{name}: written for model {fp.hex()}, expected {fingerprint}")
    if dtype is not None and found != dtype:
        raise CorruptObject(f"{name}: dtype {found}, expected {dtype}")
    shape = (two, n_tokens, heads, head_dim)
    if two != 2 or (kv_shape is not None and (heads, head_dim) != tuple(kv_shape)):
        raise CorruptObject(f"{name}: shape {list(shape)}, expected [2, n, *{list(kv_shape or [])}]")
    if length != two * n_tokens * heads * head_dim * found.itemsize or payload.nbytes != length:
        raise CorruptObject(f"{name}: {HEADER_SIZE + payload.nbytes} bytes, header says {HEADER_SIZE} + {length} "
                            f"for shape {list(shape)} {found}")
    checksum = xxhash.xxh3_64(header[:_HEAD.size])
    checksum.update(payload)
    if checksum.intdigest() != _SUM.unpack_from(header, _HEAD.size)[0]:
        raise CorruptObject(f"{name}: checksum mismatch")
    return found, shape
