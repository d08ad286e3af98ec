"""The batched read of a layer whose objects are coded (kvstore/kv_codecs.py): one read, one check pass, one decode.

A raw load's objects land straight in their spans (kvstore/reads.py, get_layer_spans). A coded object's
payload is not the bytes its spans hold, so it is read whole first: the layer's objects in one batched
call of the backend (`_get`: a pipelined GET on redis, the file reads back to back), each checked where it
landed (header, key binding, xxh3: codec.check_object), lossless payloads decompressed (zstd, per object
by nature), and then every object of the layer decoded into its spans in one C call with the GIL released
(kv_codecs.decode_spans, kvstore/csrc/kv_dequant.c), inside the load's write gate. The spans are a
kvstore.spans.SpanTable, the same table a raw load would fill: paged KV blocks and scratch
(connectors/direct_rows.py), or a staging buffer. Objects of several codecs (raw ones too) mix freely.
"""
from __future__ import annotations

import time
from typing import Sequence

import torch

from pdserve.kvstore import codec, kv_codecs
from pdserve.kvstore.errors import CorruptObject
from pdserve.kvstore.gate import WriteGate
from pdserve.kvstore.layout import Heads
from pdserve.kvstore.spans import SpanTable


class CodedReads:
    """get_layer_coded of a KVStore (its _bound, _part, _guard, _get, _count and object_name)."""

    def get_layer_coded(self, layer: int, keys: Sequence[str], spans: SpanTable, chunk_lens: Sequence[int],
                        gate: WriteGate, heads: Heads | None = None) -> tuple[int, set[str]]:
        """Read layer `layer` of consecutive chunks of any codec (their `heads` group's objects) and write
        each one's values into its spans (spans' object j: chunk j's K values, then its V values, as a raw
        payload would fill them), only inside `gate`; (the objects' stored bytes, the codecs seen). Each
        object is checked before anything is written; CorruptObject / NotFound as any read."""
        keys = list(keys)
        self._bound(layer)
        name, kv_shape = self._part(layer, heads)
        if self.dtype is None or kv_shape is None:
            raise ValueError("get_layer_coded needs a store opened with dtype and kv_shape")
        if not len(spans) == len(chunk_lens) == len(keys):
            raise ValueError(f"{len(keys)} keys, {len(spans)} span lists and {len(chunk_lens)} chunk lengths")
        dtype, dim = self.dtype, kv_shape[1]
        counts = [2 * n * kv_shape[0] * dim for n in chunk_lens]
        if [total // dtype.itemsize for total in spans.totals] != counts or \
                any(total % dtype.itemsize for total in spans.totals):
            raise ValueError("the spans do not hold the chunks' values")
        start = time.perf_counter()
        items = [(name, key) for key in keys]
        buffers = self._guard(self._get, items)
        names, sources, stored = [], [], 0
        for key, buf, n, count in zip(keys, buffers, chunk_lens, counts):
            view = memoryview(buf).cast("B")
            what = self.object_name(key, name)
            found = self._guard(codec.check_object, view, self.fingerprint, dtype, kv_shape, what, key=key,
                                layer=name, n_tokens=n)
            try:
                sources.append(kv_codecs.layer_source(view[codec.HEADER_SIZE:], found, count, dim, dtype.itemsize))
            except Exception as exc:  # a checksummed payload its codec cannot read: written by a broken writer
                raise CorruptObject(f"{what}: {found} payload does not decode: {exc}") from exc
            names.append(found)
            stored += view.nbytes
        with gate.writing():  # bounded CPU work on bytes already here: never waits for the medium
            kv_codecs.decode_spans(names, sources, counts, dim, dtype, spans.desc, spans.first, spans.bases(),
                                   spans.views)
        self._count(objects_read=len(items), bytes_read=stored, read_seconds=time.perf_counter() - start)
        return stored, set(names)
