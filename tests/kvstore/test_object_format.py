"""Object format: exact round trips, and every kind of damage is a CorruptObject, never garbage data."""
from __future__ import annotations

import pytest
import torch

from pdserve.kvstore import object_format
from pdserve.kvstore.errors import CorruptObject
from tests.helpers.kvstore import FP, OTHER_FP

KEY = "ab" * 16
AT = dict(key=KEY, layer=3)  # the name every object in this module is written and read under


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_exact_bytes(dtype):
    t = torch.randn(2, 13, 4, 8).to(dtype)
    blob = object_format.encode_bytes(t, FP, **AT)
    assert len(blob) == object_format.HEADER_SIZE + t.numel() * t.element_size()
    for buf in (blob, bytearray(blob)):  # read-only (redis) and writable (file) buffers
        out = object_format.decode(buf, FP, dtype, (4, 8), **AT)
        assert out.dtype == dtype and out.shape == t.shape
        assert out.view(torch.uint8).flatten().tolist() == t.view(torch.uint8).flatten().tolist()


def test_writable_buffer_is_decoded_without_copy():
    buf = bytearray(object_format.encode_bytes(torch.ones(2, 4, 2, 8), FP, **AT))
    out = object_format.decode(buf, FP, **AT)
    buf[-4:] = bytes(4)  # the tensor shares the buffer's memory
    assert out[1, -1, -1, -1].item() == 0.0


def test_non_contiguous_input_is_stored_in_logical_order():
    t = torch.randn(2, 8, 4, 6).transpose(2, 3).contiguous().transpose(2, 3)
    assert not t.is_contiguous()
    assert torch.equal(object_format.decode(object_format.encode_bytes(t, FP, **AT), FP, **AT), t)


def _damaged(blob: bytes, offset: int) -> bytes:
    raw = bytearray(blob)
    raw[offset] ^= 0x40
    return bytes(raw)


@pytest.mark.parametrize("offset,reason", [(0, "magic"), (4, "version"), (6, "dtype"), (12, "header says"),
                                           (50, "checksum"), (object_format.HEADER_SIZE + 7, "checksum"),
                                           (-1, "checksum")])
def test_flipped_bits_are_corrupt(offset, reason):
    blob = object_format.encode_bytes(torch.randn(2, 5, 2, 8), FP, **AT)
    with pytest.raises(CorruptObject, match=reason):
        object_format.decode(_damaged(blob, offset), FP, **AT)


def test_truncated_and_empty_objects_are_corrupt():
    blob = object_format.encode_bytes(torch.randn(2, 5, 2, 8), FP, **AT)
    for cut in (len(blob) - 1, object_format.HEADER_SIZE, 10, 0):
        with pytest.raises(CorruptObject):
            object_format.decode(blob[:cut], FP, **AT)


def test_wrong_model_dtype_or_shape_is_corrupt():
    blob = object_format.encode_bytes(torch.randn(2, 5, 2, 8).half(), FP, **AT)
    with pytest.raises(CorruptObject, match="model"):
        object_format.decode(blob, OTHER_FP, **AT)
    with pytest.raises(CorruptObject, match="dtype"):
        object_format.decode(blob, FP, torch.bfloat16, **AT)
    with pytest.raises(CorruptObject, match="shape"):
        object_format.decode(blob, FP, torch.float16, (8, 2), **AT)


def test_bad_inputs_are_value_errors():
    with pytest.raises(ValueError, match="2, n_tokens"):
        object_format.encode(torch.zeros(3, 4, 2, 8), FP, **AT)
    with pytest.raises(ValueError, match="dtype"):
        object_format.encode(torch.zeros(2, 4, 2, 8, dtype=torch.int32), FP, **AT)
    with pytest.raises(ValueError, match="fingerprint"):
        object_format.encode(torch.zeros(2, 4, 2, 8), "xyz", **AT)
    assert object_format.as_dtype("torch.bfloat16") is torch.bfloat16


def test_object_is_bound_to_its_chunk_key_and_layer():
    blob = object_format.encode_bytes(torch.randn(2, 5, 2, 8), FP, **AT)
    for key, layer in (("cd" * 16, 3), (KEY, 2)):  # a valid object read under another name
        with pytest.raises(CorruptObject, match="another chunk or layer"):
            object_format.decode(blob, FP, key=key, layer=layer)
    binding = object_format.binding
    assert binding(KEY, 3) != binding(KEY, 4) and binding(KEY, 3) == binding(KEY, 3)
    old = bytearray(blob)
    old[4] = 1  # a version-1 object (no binding): never read as if it were bound
    with pytest.raises(CorruptObject, match="format version 1"):
        object_format.decode(bytes(old), FP, **AT)


def test_split_payload_views_round_trip_through_a_token_slice_of_a_larger_buffer():
    t = torch.randn(2, 6, 2, 8)
    staging = torch.zeros(2, 20, 2, 8)
    target = staging[:, 7:13]  # not contiguous; each of K and V is
    views = object_format.payload_views(target)
    assert [v.nbytes for v in views] == [t[0].nbytes, t[1].nbytes]
    blob = memoryview(object_format.encode_bytes(t, FP, **AT))
    offset = object_format.HEADER_SIZE
    for v in views:
        v[:] = blob[offset:offset + v.nbytes]
        offset += v.nbytes
    object_format.check_payload(blob[:object_format.HEADER_SIZE], views, FP, target.dtype, tuple(target.shape), **AT)
    assert torch.equal(target, t) and staging[:, :7].abs().sum() == 0 and staging[:, 13:].abs().sum() == 0
    header, spans = object_format.encode(target, FP, **AT)  # written from the slice without a copy, same bytes
    assert b"".join((header, *spans)) == bytes(blob)
    with pytest.raises(ValueError, match="halves"):
        object_format.payload_views(staging[:, :, :1])
