"""The on-store object format: one (chunk, layer) KV tensor as raw bytes behind a 64-byte header.

Layout (little endian), format version 2:
    0  magic b"PDKV" | 4 version u16 | 6 dtype code u8 | 7 codec u8 (kvstore/payload_codecs.py; 0 raw)
    8  shape [2, n_tokens, num_kv_heads, head_dim] as 4 x u32
    24 model fingerprint (16 bytes) | 40 payload length u64
    48 binding u64: xxh3_64 of the chunk key and layer the object was written under
    56 xxh3_64 checksum u64 of bytes [0, 56) and the payload
    64 payload: the tensor's bytes in C order (64-byte aligned inside the object), or the codec's
       encoding of them (then the payload length is the encoding's; dtype and shape are the tensor's)

The binding ties an object to its name: a valid object copied or renamed under another
chunk's key (or another layer) fails the load as corrupt instead of feeding a request
another prompt's KV. The checksum covers the header too, so a flipped dtype, shape or
binding is caught as surely as a flipped payload byte. Decoding never unpickles anything:
a shared store is writable by others, and reading it must not execute code.

Payload views: a tensor [2, n, H, D] whose K half and V half are each contiguous (a whole
contiguous tensor, or a token slice `staging[:, a:b]` of a larger [2, T, H, D] buffer) is
written from and read into without a copy, as one or two byte spans (`payload_views`).
"""
from __future__ import annotations

import functools
import struct
import warnings
from typing import Sequence

import numpy as np
import torch
import xxhash

from pdserve.kvstore import payload_codecs
from pdserve.kvstore.errors import CorruptObject

MAGIC = b"PDKV"
VERSION = 2
HEADER_SIZE = 64
_HEAD = struct.Struct("<4sHBB4I16sQQ")  # magic .. binding: the checksummed part
_SUM = struct.Struct("<Q")
SUMMED = _HEAD.size  # header bytes under the checksum (56), which fills the rest of the header
assert SUMMED + _SUM.size == HEADER_SIZE
_BINDING_OFFSET = 48
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


def binding(key: str, layer: int | str) -> int:
    """The 64-bit digest that binds an object to the (chunk key, layer) it is stored under; `layer` is the
    object's layer name (kvstore/layout.py object_layer: the layer, or `<layer>.h<lo>-<hi>` for a head
    group), so a head group's object moved under another group's name is as wrong as under another layer's."""
    return xxhash.xxh3_64_intdigest(b"%s\0%s" % (key.encode(), str(layer).encode()))


def encode(tensor: torch.Tensor, fingerprint: str, *, key: str, layer: int | str, codec: str = payload_codecs.RAW
           ) -> tuple[bytes, list[memoryview]]:
    """(header, payload spans) of a [2, n_tokens, kv_heads, head_dim] tensor stored as layer `layer`
    of chunk `key` under `codec`. A raw payload is not copied when the tensor's halves are contiguous,
    so file writes go straight from the tensor (os.writev)."""
    if tensor.dim() != 4 or tensor.shape[0] != 2:
        raise ValueError(f"KV layer tensor must be [2, n_tokens, kv_heads, head_dim], got {list(tensor.shape)}")
    code = DTYPE_CODES.get(tensor.dtype)
    if code is None:
        raise ValueError(f"unsupported KV dtype {tensor.dtype}")
    tensor = tensor.detach().cpu()
    if codec != payload_codecs.RAW:
        payload = [memoryview(payload_codecs.encode(tensor.contiguous(), codec))]
    else:
        try:
            payload = payload_views(tensor)
        except ValueError:
            payload = payload_views(tensor.contiguous())
    length = sum(v.nbytes for v in payload)
    head = _HEAD.pack(MAGIC, VERSION, code, payload_codecs.CODES[codec], *tensor.shape, fingerprint_bytes(fingerprint),
                      length, binding(key, layer))
    return head + _SUM.pack(_checksum(head, payload)), payload


def encode_bytes(tensor: torch.Tensor, fingerprint: str, *, key: str, layer: int | str,
                 codec: str = payload_codecs.RAW) -> bytes:
    """The whole object as one contiguous value (what a key-value store needs)."""
    header, payload = encode(tensor, fingerprint, key=key, layer=layer, codec=codec)
    return b"".join((header, *payload))


def payload_views(tensor: torch.Tensor) -> list[memoryview]:
    """The payload bytes of a CPU tensor [2, n, H, D] in C order, without a copy (writable, so reads
    can land in them): one span for a contiguous tensor, two (K, V) when only each half is."""
    if tensor.device.type != "cpu":
        raise ValueError("expected a CPU tensor")
    if tensor.is_contiguous():
        return [_bytes_of(tensor)]
    if tensor.dim() == 4 and tensor.shape[0] == 2 and tensor[0].is_contiguous() and tensor[1].is_contiguous():
        return [_bytes_of(tensor[0]), _bytes_of(tensor[1])]
    raise ValueError("expected a CPU tensor whose K and V halves are each contiguous")


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (writable: reads can land in it)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("expected a contiguous CPU tensor")
    return _bytes_of(tensor)


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def decode(buf: bytes | bytearray | memoryview, fingerprint: str, dtype: torch.dtype | None = None,
           kv_shape: Sequence[int] | None = None, name: str = "object", *, key: str, layer: int) -> torch.Tensor:
    """Validate everything (including that the object belongs to layer `layer` of chunk `key`) and
    return the [2, n, H, D] tensor, decoded by the codec its header names; raises CorruptObject on
    any mismatch.

    A raw payload becomes the tensor's storage without a copy. A read-only one (bytes from
    redis) is aliased too: the result is for reading (scatter into paged memory), never for
    writing — copying it into fresh memory would halve redis read throughput (page faults).
    """
    view = memoryview(buf).cast("B")
    if view.nbytes < HEADER_SIZE:
        raise CorruptObject(f"{name}: {view.nbytes} bytes is shorter than the {HEADER_SIZE}-byte header")
    found, shape = _check(view[:HEADER_SIZE], [view[HEADER_SIZE:]], fingerprint, dtype, kv_shape, name, key, layer)
    codec = codec_of(view)
    if codec != payload_codecs.RAW:
        try:
            return payload_codecs.decode(view[HEADER_SIZE:], codec, found, shape)
        except Exception as exc:  # a checksummed payload its codec cannot read: written by a broken writer
            raise CorruptObject(f"{name}: {codec} payload does not decode: {exc}") from exc
    if view.nbytes == HEADER_SIZE:
        return torch.empty(shape, dtype=found)
    return torch.frombuffer(view, dtype=found, offset=HEADER_SIZE).view(shape)


def check_object(view: memoryview, fingerprint: str, dtype: torch.dtype, kv_shape: Sequence[int], name: str, *,
                 key: str, layer: int | str, n_tokens: int) -> str:
    """Validate a whole object of any codec (as decode does, without decoding it) holding `n_tokens` tokens of
    a `dtype` [2, n, *kv_shape] tensor of layer `layer` of chunk `key`; its codec's name. The batched coded
    load's check: one compare of the header bytes it must have and one xxh3 pass; CorruptObject (with the
    precise reason, worked out only then) otherwise."""
    shape = (2, n_tokens, *kv_shape)
    if view.nbytes >= HEADER_SIZE and view[7] in payload_codecs.NAMES:
        length = view.nbytes - HEADER_SIZE
        raw = view[7] == payload_codecs.CODES[payload_codecs.RAW]
        want = _HEAD.pack(MAGIC, VERSION, DTYPE_CODES[dtype], view[7], *shape, fingerprint_bytes(fingerprint), length,
                          binding(key, layer))
        if view[:_HEAD.size] == want and (not raw or length == shape[1] * shape[2] * shape[3] * 2 * dtype.itemsize) \
                and _checksum(view[:_HEAD.size], [view[HEADER_SIZE:]]) == _SUM.unpack_from(view, _HEAD.size)[0]:
            return payload_codecs.NAMES[view[7]]
    if view.nbytes < HEADER_SIZE:
        raise CorruptObject(f"{name}: {view.nbytes} bytes is shorter than the {HEADER_SIZE}-byte header")
    _, found = _check(view[:HEADER_SIZE], [view[HEADER_SIZE:]], fingerprint, dtype, kv_shape, name, key, layer)
    raise CorruptObject(f"{name}: {found[1]} tokens, expected {n_tokens}")


def codec_of(header: bytes | bytearray | memoryview) -> str:
    """The codec an object's header names (checked by _check: a known one)."""
    return payload_codecs.NAMES[memoryview(header).cast("B")[7]]


def header_codec(header: bytes | bytearray | memoryview) -> tuple[str, int]:
    """(codec name, bytes its tensor would take raw) of an object's first HEADER_SIZE bytes, unchecked (what
    `pd-kvstore stats` counts; verify checks); ("unknown", 0) for bytes that are no header."""
    view = memoryview(header).cast("B")
    if view.nbytes < HEADER_SIZE or view[:4] != MAGIC or view[7] not in payload_codecs.NAMES:
        return "unknown", 0
    return payload_codecs.NAMES[view[7]], raw_bytes(view)


def raw_bytes(header: bytes | bytearray | memoryview) -> int:
    """What an object's tensor would take raw (its payload length when it is raw)."""
    _, _, code, _, two, n_tokens, heads, head_dim, _, _, _ = _HEAD.unpack_from(header)
    dtype = CODE_DTYPES.get(code)
    return two * n_tokens * heads * head_dim * (dtype.itemsize if dtype else 0)


def check_size(name: str, size: int, payload: list[memoryview], shape: tuple[int, ...], dtype: torch.dtype,
               nbytes: int | None = None) -> None:
    """CorruptObject unless a stored object of `size` bytes is a header plus exactly the payload
    spans it is about to be read into (checked before reading, so a wrong-size object is never
    read into them). `nbytes`: the spans' total, when the caller has it."""
    want = sum(span.nbytes for span in payload) if nbytes is None else nbytes
    if size != HEADER_SIZE + want:
        raise CorruptObject(f"{name}: {size} bytes, expected {HEADER_SIZE} + {want} for {list(shape)} {dtype}")


def expected_header(fingerprint: str, dtype: torch.dtype, shape: tuple[int, ...], *, key: str, layer: int) -> bytes:
    """The checksummed header bytes [0, 56) of the one valid object for layer `layer` of chunk `key`
    holding a `dtype` tensor of `shape` [2, n, H, D]."""
    return expected_coded_header(fingerprint, dtype, shape, key=key, layer=layer, codec=payload_codecs.RAW,
                                 length=shape[0] * shape[1] * shape[2] * shape[3] * dtype.itemsize)


def expected_coded_header(fingerprint: str, dtype: torch.dtype, shape: tuple[int, ...], *, key: str,
                          layer: int | str, codec: str, length: int) -> bytes:
    """expected_header of an object of codec `codec` whose payload is `length` bytes."""
    return _HEAD.pack(MAGIC, VERSION, DTYPE_CODES[dtype], payload_codecs.CODES[codec], *shape,
                      fingerprint_bytes(fingerprint), length, binding(key, layer))


def digest_matches(header: memoryview, digest: int) -> bool:
    """Whether `digest` (xxh3 over header bytes [0, SUMMED) and the payload, computed where they landed) is
    the checksum the header carries."""
    return digest == _SUM.unpack_from(header, _HEAD.size)[0]


def check_payload(header: bytes | bytearray | memoryview, payload: list[memoryview], fingerprint: str,
                  dtype: torch.dtype, shape: tuple[int, ...], name: str = "object", *, key: str, layer: int,
                  nbytes: int | None = None) -> None:
    """Validate an object whose payload spans were read in place: CorruptObject unless its header is
    exactly that of layer `layer` of chunk `key` with a `dtype` tensor of `shape`, and the xxh3 over
    header and payload matches. The load hot path: one compare of the expected header bytes and one
    hash pass (over spans just read, still in cache); the precise reason is worked out only on failure.
    `nbytes`: the spans' total, when the caller has it."""
    view = memoryview(header).cast("B")
    length = shape[0] * shape[1] * shape[2] * shape[3] * dtype.itemsize
    if view.nbytes >= HEADER_SIZE and (sum(span.nbytes for span in payload) if nbytes is None else nbytes) == length \
            and \
            view[:_HEAD.size] == expected_header(fingerprint, dtype, shape, key=key, layer=layer):
        if _checksum(view[:_HEAD.size], payload) == _SUM.unpack_from(view, _HEAD.size)[0]:
            return
    if view.nbytes < HEADER_SIZE:
        raise CorruptObject(f"{name}: {view.nbytes} bytes is shorter than the {HEADER_SIZE}-byte header")
    _, found = _check(view[:HEADER_SIZE], payload, fingerprint, dtype, shape[2:], name, key, layer)
    if found != tuple(shape):
        raise CorruptObject(f"{name}: shape {list(found)}, expected {list(shape)}")


def header_and_digest_match(header: memoryview, digest: int, fingerprint: str, dtype: torch.dtype,
                            shape: tuple[int, ...], *, key: str, layer: int) -> bool:
    """Whether `header` is exactly the one valid header of layer `layer` of chunk `key` holding a `dtype`
    tensor of `shape`, and `digest` (xxh3_64 over header bytes [0, 56) and the payload, computed by a
    reader that hashed the payload where it landed) is the checksum it carries. False: check_payload
    over the same bytes says why."""
    return header[:_HEAD.size] == expected_header(fingerprint, dtype, shape, key=key, layer=layer) and \
        digest_matches(header, digest)


def _checksum(head: bytes | memoryview, payload: list[memoryview]) -> int:
    checksum = xxhash.xxh3_64(head)
    for span in payload:
        checksum.update(span)
    return checksum.intdigest()


def _check(header: memoryview, payload: list[memoryview], fingerprint: str, dtype: torch.dtype | None,
           kv_shape: Sequence[int] | None, name: str, key: str, layer: int
           ) -> tuple[torch.dtype, tuple[int, int, int, int]]:
    """Validate header fields against the expectations and the checksum over header + payload."""
    magic, version, code, codec, two, n_tokens, heads, head_dim, fp, length, bound = _HEAD.unpack_from(header)
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
    if codec not in payload_codecs.NAMES:
        raise CorruptObject(f"{name}: unknown codec {codec}")
    size = sum(v.nbytes for v in payload)
    raw = codec == payload_codecs.CODES[payload_codecs.RAW]
    if (raw and length != two * n_tokens * heads * head_dim * found.itemsize) or size != length:
        raise CorruptObject(f"{name}: {HEADER_SIZE + size} bytes, header says {HEADER_SIZE} + {length} "
                            f"for shape {list(shape)} {found}")
    if _checksum(header[:_HEAD.size], payload) != _SUM.unpack_from(header, _HEAD.size)[0]:
        raise CorruptObject(f"{name}: checksum mismatch")
    if bound != binding(key, layer):  # after the checksum: a damaged object is reported as damaged
        raise CorruptObject(f"{name}: a valid object of another chunk or layer, stored under the wrong key")
    return found, shape


def heads_of(tensor: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """KV heads [lo, hi) of a [2, n, H, D] CPU tensor, contiguous: copied in numpy, single-threaded (puts run on
    the store's I/O threads, which never start an OpenMP team of their own: docs/architecture.md)."""
    part = tensor.detach().cpu()[:, :, lo:hi]
    out = torch.empty(part.shape, dtype=part.dtype)
    np.copyto(out.view(torch.uint8).numpy(), part.view(torch.uint8).numpy())
    return out
