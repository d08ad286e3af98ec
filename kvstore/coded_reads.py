"""The batched read of a layer whose objects are coded (kvstore/payload_codecs.py): one read, one check pass, one decode.

A raw load's objects land straight in their spans (kvstore/reads.py, get_layer_spans). A coded object's
payload is not the bytes its spans hold, so it is read whole first: the layer's objects in one batched
call of the backend (`_get`: a pipelined GET on redis, the file reads back to back), each checked where it
landed (header, key binding, xxh3: object_format.check_object), lossless payloads decompressed (zstd, per object
by nature), and then every object of the layer decoded into its spans in one C call with the GIL released
(payload_codecs.decode_spans, kvstore/csrc/kv_dequant.c), inside the load's write gate. The spans are a
kvstore.spans.SpanTable, the same table a raw load would fill: paged KV blocks and scratch
(connectors/direct_rows.py), or a staging buffer. Objects of several codecs (raw ones too) mix freely.
"""
from __future__ import annotations

import time
from typing import Protocol, Sequence

from pdserve.kvstore import object_format, payload_codecs
from pdserve.kvstore.binding import ModelBinding
from pdserve.kvstore.calls import StoreCalls
from pdserve.kvstore.errors import CorruptObject
from pdserve.kvstore.gate import WriteGate
from pdserve.kvstore.layout import Heads
from pdserve.kvstore.records import Buffer
from pdserve.kvstore.spans import SpanTable


class CodedObjectReads(Protocol):
    """The backend reads a coded layer read makes (kvstore/base.py's read hooks)."""

    def object_name(self, key: str, layer: int | str) -> str: ...

    def _get(self, items: list[tuple[int | str, str]]) -> list[Buffer]: ...

    def _get_whole(self, items: list[tuple[int | str, str]], sizes: list[int], expect: bytes
                   ) -> tuple[list[memoryview], memoryview, list[int]] | None: ...


class CodedReader:
    """get_layer_coded of a store: checked against its `model`, read through its `backend`, made and counted
    through its `calls`."""

    def __init__(self, model: ModelBinding, backend: CodedObjectReads, calls: StoreCalls) -> None:
        self._model = model
        self._backend = backend
        self._calls = calls

    def get_layer_coded(self, layer: int, keys: Sequence[str], spans: SpanTable, chunk_lens: Sequence[int],
                        gate: WriteGate, heads: Heads | None = None,
                        codecs: Sequence[str] | None = None) -> tuple[int, set[str]]:
        """Read layer `layer` of consecutive chunks of any codec (their `heads` group's objects) and write
        each one's values into its spans (spans' object j: chunk j's K values, then its V values, as a raw
        payload would fill them), only inside `gate`; (the objects' stored bytes, the codecs seen). Each
        object is checked before anything is written; CorruptObject / NotFound as any read. `codecs`: each
        chunk's codec as its commit marker says (kvstore/layout.py), when known: objects of a fixed-size
        codec are then received whole by the backend's compiled receiver (`_get_whole`), where it has one."""
        keys = list(keys)
        self._model.check(layer)
        name, kv_shape = self._model.part(layer, heads)
        if self._model.dtype is None or kv_shape is None:
            raise ValueError("get_layer_coded needs a store opened with dtype and kv_shape")
        if not len(spans) == len(chunk_lens) == len(keys):
            raise ValueError(f"{len(keys)} keys, {len(spans)} span lists and {len(chunk_lens)} chunk lengths")
        dtype, dim = self._model.dtype, kv_shape[1]
        counts = [2 * n * kv_shape[0] * dim for n in chunk_lens]
        if [total // dtype.itemsize for total in spans.totals] != counts or \
                any(total % dtype.itemsize for total in spans.totals):
            raise ValueError("the spans do not hold the chunks' values")
        start = time.perf_counter()
        items = [(name, key) for key in keys]
        whole = self._read_whole(items, keys, name, kv_shape, chunk_lens, counts, codecs)
        if whole is not None:
            names, sources, stored = whole
        else:
            names, sources, stored = self._read_checked(items, keys, name, kv_shape, chunk_lens, counts)
        with gate.writing():  # bounded CPU work on bytes already here: never waits for the medium
            payload_codecs.decode_spans(names, sources, counts, dim, dtype, spans.desc, spans.first, spans.bases(),
                                   spans.views)
        self._calls.count(objects_read=len(items), bytes_read=stored, read_seconds=time.perf_counter() - start)
        return stored, set(names)

    def _read_whole(self, items: list[tuple[int | str, str]], keys: list[str], name: int | str,
                    kv_shape: tuple[int, ...], chunk_lens: Sequence[int], counts: list[int],
                    codecs: Sequence[str] | None) -> tuple[list[str], list[memoryview], int] | None:
        """The objects received whole by the backend's compiled receiver into this thread's scratch and checked
        there (header and xxh3 computed as they landed): (codec names, payloads, stored bytes). None where the
        codecs are not all known and of a fixed size, the backend has no such receiver, or an object is not
        exactly what its marker says (the checked read then reads the layer again and says why)."""
        dtype, dim = self._model.dtype, kv_shape[1]
        if codecs is None or len(codecs) != len(keys):
            return None
        sizes = [payload_codecs.payload_bytes(c, count, dim, dtype.itemsize) for c, count in zip(codecs, counts)]
        if any(size is None for size in sizes):
            return None
        expect = [object_format.expected_coded_header(self._model.fingerprint, dtype, (2, n, *kv_shape), key=key, layer=name,
                                              codec=c, length=size)
                  for key, c, n, size in zip(keys, codecs, chunk_lens, sizes)]
        got = self._calls.guard(self._backend._get_whole, items, sizes, b"".join(expect))
        if got is None:
            return None
        payloads, headers, digests = got
        for i, want in enumerate(expect):
            header = headers[object_format.HEADER_SIZE * i:object_format.HEADER_SIZE * (i + 1)]
            if header[:object_format.SUMMED] != want or not object_format.digest_matches(header, digests[i]):
                return None  # damaged, or rewritten with another codec since its marker was read: read it again
        sources, stored = payloads, sum(object_format.HEADER_SIZE + size for size in sizes)
        return list(codecs), sources, stored

    def _read_checked(self, items: list[tuple[int | str, str]], keys: list[str], name: int | str,
                      kv_shape: tuple[int, ...], chunk_lens: Sequence[int], counts: list[int]
                      ) -> tuple[list[str], list[memoryview], int]:
        """The objects read by the backend's plain batched read and checked one by one in Python."""
        dtype, dim = self._model.dtype, kv_shape[1]
        buffers = self._calls.guard(self._backend._get, items)
        names, sources, stored = [], [], 0
        for key, buf, n, count in zip(keys, buffers, chunk_lens, counts):
            view = memoryview(buf).cast("B")
            what = self._backend.object_name(key, name)
            found = self._calls.guard(object_format.check_object, view, self._model.fingerprint, dtype, kv_shape, what, key=key,
                                layer=name, n_tokens=n)
            try:
                sources.append(payload_codecs.layer_source(view[object_format.HEADER_SIZE:], found, count, dim, dtype.itemsize))
            except Exception as exc:  # a checksummed payload its codec cannot read: written by a broken writer
                raise CorruptObject(f"{what}: {found} payload does not decode: {exc}") from exc
            names.append(found)
            stored += view.nbytes
        return names, sources, stored
