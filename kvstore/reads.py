"""The read half of a KV store: layers of chunks into fresh tensors, reused buffers or paged KV blocks.

`LayerReads` is mixed into kvstore.base.KVStore (its _bound, _guard, _count, _get, submit and
object_name); kvstore/base.py's docstring is the API. Every read checks each object (header, key
binding, xxh3) where it landed before the call returns. Backends that read straight into the
destination override `_get_spans` / `_get_table` (kvstore/fs_read.py, kvstore/redis_store.py); a
store's compiled reader (`span_reader`, kvstore/native_reader.py) takes a whole layer in one call.
"""
from __future__ import annotations

import concurrent.futures
import time
from typing import Any, Sequence

import torch

from pdserve.kvstore import object_format
from pdserve.kvstore.gate import NO_GATE, WriteGate
from pdserve.kvstore.layout import Heads
from pdserve.kvstore.native_reader import native_reader
from pdserve.kvstore.spans import SpanReader, SpanTable, copy_into

_UNSET: Any = object()


class LayerReads:
    """get_layer, get_layer_into, get_layer_spans, get_layers and get_layers_async of a KVStore."""

    fingerprint: str | None
    dtype: torch.dtype | None
    kv_shape: tuple[int, ...] | None
    _span_reader: Any = _UNSET

    @property
    def span_reader(self) -> SpanReader | None:
        """The compiled reader of loads into spans (kvstore/native_reader.py), taken at the first load that
        asks; None: the Python paths (PDSERVE_KERNELS=torch, or no library here). Tests and benchmarks
        set it to choose a path."""
        if self._span_reader is _UNSET:
            self._span_reader = native_reader()
        return self._span_reader

    @span_reader.setter
    def span_reader(self, reader: SpanReader | None) -> None:
        self._span_reader = reader

    def get_layer(self, layer: int, keys: Sequence[str], out: Sequence[torch.Tensor] | None = None,
                  heads: Heads | None = None) -> list[torch.Tensor]:
        """Read and validate layer `layer` of several chunks, in order. NotFound if any is missing.

        With `out` (one preallocated CPU tensor per key, of the expected dtype and
        [2, n_tokens, H, D] shape, each half contiguous), the bytes land in those tensors and
        they are returned: a connector reusing staging buffers pays no allocation or page
        faults per load. `heads`: read the objects of that KV head group (kvstore/layout.py) instead of
        the whole-heads ones."""
        return self.get_layers([layer], keys, None if out is None else [out], heads=heads)[0]

    def get_layer_into(self, layer: int, keys: Sequence[str], staging: torch.Tensor, chunk_lens: Sequence[int],
                       heads: Heads | None = None) -> int:
        """Read layer `layer` of consecutive chunks into one reused contiguous CPU tensor [2, T, H, D]
        (T = sum(chunk_lens)), chunk j at its token slice; returns the payload bytes read.

        The decode hot path: each object is read straight into its slice of `staging` (files: readv)
        and checked there (header, key binding, xxh3) while it is still in cache; one byte view of
        the buffer serves every chunk, so no tensor is made per chunk. A chunk that holds another
        number of tokens than chunk_lens[j] is CorruptObject, a missing one NotFound."""
        keys = list(keys)
        self._bound(layer)
        name, kv_shape = self._part(layer, heads)
        if len(chunk_lens) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(chunk_lens)} chunk lengths")
        if staging.device.type != "cpu" or not staging.is_contiguous() or staging.dim() != 4 or \
                staging.shape[0] != 2 or staging.shape[1] != sum(chunk_lens):
            raise ValueError(f"staging must be a contiguous CPU tensor [2, {sum(chunk_lens)}, H, D], "
                             f"got {list(staging.shape)}")
        if self.dtype is not None and staging.dtype != self.dtype:
            raise ValueError(f"staging tensor of dtype {staging.dtype}, store holds {self.dtype}")
        if kv_shape is not None and tuple(staging.shape[2:]) != kv_shape:
            raise ValueError(f"staging shape {list(staging.shape)}, store holds [2, T, {kv_shape[0]}, "
                             f"{kv_shape[1]}]")
        start = time.perf_counter()
        whole = object_format.tensor_bytes(staging)
        row = whole.nbytes // (2 * staging.shape[1]) if staging.shape[1] else 0
        half = whole.nbytes // 2
        spans, shapes, offset = [], [], 0
        heads, dim = staging.shape[2], staging.shape[3]
        for n in chunk_lens:
            a, b = offset * row, (offset + n) * row
            spans.append([whole[a:b], whole[half + a:half + b]])
            shapes.append((2, n, heads, dim))
            offset += n
        self._guard(self._get_spans, [(name, key) for key in keys], spans, shapes, staging.dtype)
        self._count(objects_read=len(keys), bytes_read=object_format.HEADER_SIZE * len(keys) + whole.nbytes,
                    read_seconds=time.perf_counter() - start)
        return whole.nbytes

    def get_layer_spans(self, layer: int, keys: Sequence[str], spans: SpanTable | Sequence[Sequence[memoryview]],
                        chunk_lens: Sequence[int], gate: WriteGate, heads: Heads | None = None) -> int:
        """Read layer `layer` of consecutive chunks straight into memory the caller may take back (paged
        KV blocks); returns the payload bytes read.

        spans[j] are byte spans that chunk j's payload fills in order (its K rows, then its V rows,
        split anywhere: block pieces, scratch for rows not wanted), as memoryviews or as one
        kvstore.spans.SpanTable (what the compiled file reader takes), chunk_lens[j] its token count. Bytes
        reach the spans only inside `gate` (kvstore.gate): once the caller closed it, a read that
        returns late writes nothing there and the call raises LoadAbandoned. Each object is checked
        (header, key binding, xxh3) right after it landed; an error leaves the spans partly written
        (the caller recomputes over them). Needs a store opened with dtype and kv_shape. `heads`: the
        objects of that KV head group (kvstore/layout.py)."""
        keys = list(keys)
        self._bound(layer)
        name, kv_shape = self._part(layer, heads)
        if self.dtype is None or self.kv_shape is None:
            raise ValueError("get_layer_spans needs a store opened with dtype and kv_shape")
        if not len(spans) == len(chunk_lens) == len(keys):
            raise ValueError(f"{len(keys)} keys, {len(spans)} span lists and {len(chunk_lens)} chunk lengths")
        start = time.perf_counter()
        shapes = [(2, n, *kv_shape) for n in chunk_lens]
        items = [(name, key) for key in keys]
        if isinstance(spans, SpanTable):
            self._guard(self._get_table, items, spans, shapes, self.dtype, gate)
        else:
            self._guard(self._get_spans, items, [list(row) for row in spans], shapes, self.dtype, gate)
        nbytes = 2 * sum(chunk_lens) * kv_shape[0] * kv_shape[1] * self.dtype.itemsize  # checked per object
        self._count(objects_read=len(keys), bytes_read=object_format.HEADER_SIZE * len(keys) + nbytes,
                    read_seconds=time.perf_counter() - start)
        return nbytes

    def get_layers(self, layers: Sequence[int], keys: Sequence[str],
                   out: Sequence[Sequence[torch.Tensor]] | None = None, heads: Heads | None = None
                   ) -> list[list[torch.Tensor]]:
        """Layers x chunks in one call: result[i][j] is layer layers[i] of chunk keys[j] (see the
        module docstring for `out` and the round trips); `heads`: that KV head group's objects."""
        layers, keys = list(layers), list(keys)
        self._check_request(layers, keys, out)
        return self._read(layers, keys, out, heads)

    def get_layers_async(self, layers: Sequence[int], keys: Sequence[str],
                         out: Sequence[Sequence[torch.Tensor]] | None = None) -> list[concurrent.futures.Future]:
        """get_layers in the background, one Future per layer (in `layers` order) resolving to that
        layer's tensors; bad arguments raise ValueError here, store errors come from the futures."""
        layers, keys = list(layers), list(keys)
        self._check_request(layers, keys, out)
        return [self.submit(self._read_layer, layer, keys, None if out is None else list(out[i]))
                for i, layer in enumerate(layers)]

    def get_layer_decoded(self, layer: int, keys: Sequence[str], heads: Heads | None = None
                          ) -> tuple[list[torch.Tensor], int, set[str]]:
        """Layer `layer` of several chunks (their `heads` group's objects), each decoded by the codec its
        header names into a fresh tensor: (tensors, the objects' stored bytes, the codecs seen). The read of
        chunks another layout or a codec wrote (connectors/store_connector.py)."""
        keys = list(keys)
        self._bound(layer)
        name, kv_shape = self._part(layer, heads)
        items = [(name, key) for key in keys]
        start = time.perf_counter()
        buffers = self._guard(self._get, items)
        views = [memoryview(buf).cast("B") for buf in buffers]
        tensors = [self._guard(object_format.decode, view, self.fingerprint, self.dtype, kv_shape,
                               self.object_name(key, name), key=key, layer=name) for key, view in zip(keys, views)]
        stored = sum(view.nbytes for view in views)
        self._count(objects_read=len(items), bytes_read=stored, read_seconds=time.perf_counter() - start)
        return tensors, stored, {object_format.codec_of(view) for view in views}

    def _read_layer(self, layer: int, keys: list[str], out: list[torch.Tensor] | None) -> list[torch.Tensor]:
        return self._read([layer], keys, None if out is None else [out])[0]

    def _read(self, layers: list[int], keys: list[str], out: Sequence[Sequence[torch.Tensor]] | None,
              heads: Heads | None = None) -> list[list[torch.Tensor]]:
        """get_layers after its argument checks."""
        kv_shape = self._part(0, heads)[1]
        items = [(self._part(layer, heads)[0], key) for layer in layers for key in keys]
        start = time.perf_counter()
        if out is None:
            buffers = self._guard(self._get, items)
            flat = [self._guard(object_format.decode, buf, self.fingerprint, self.dtype, kv_shape,
                                self.object_name(key, layer), key=key, layer=layer)
                    for (layer, key), buf in zip(items, buffers)]
        else:
            flat = [t for row in out for t in row]
            self._guard(self._get_into, items, flat)
        self._count(objects_read=len(items), bytes_read=sum(object_format.HEADER_SIZE + t.nbytes for t in flat),
                    read_seconds=time.perf_counter() - start)
        return [flat[i * len(keys):(i + 1) * len(keys)] for i in range(len(layers))]

    def _check_request(self, layers: list[int], keys: list[str],
                       out: Sequence[Sequence[torch.Tensor]] | None) -> None:
        for layer in layers:
            self._bound(layer)
        self._bound()
        if out is None:
            return
        if len(out) != len(layers):
            raise ValueError(f"{len(layers)} layers but {len(out)} rows of output tensors")
        for row in out:
            if len(row) != len(keys):
                raise ValueError(f"{len(keys)} keys but {len(row)} output tensors")
            for tensor in row:
                if self.dtype is not None and tensor.dtype != self.dtype:
                    raise ValueError(f"output tensor of dtype {tensor.dtype}, store holds {self.dtype}")
                object_format.payload_views(tensor)  # ValueError unless a CPU tensor with contiguous K and V halves

    def _get_into(self, items: list[tuple[int, str]], out: list[torch.Tensor]) -> None:
        """Fill preallocated tensors (each K and V half contiguous)."""
        self._get_spans(items, [object_format.payload_views(t) for t in out], [tuple(t.shape) for t in out],
                        out[0].dtype if out else torch.uint8)

    def _get_spans(self, items: list[tuple[int, str]], spans: list[list[memoryview]], shapes: list[tuple[int, ...]],
                   dtype: torch.dtype, gate: WriteGate = NO_GATE) -> None:
        """Read each (layer, key) object's payload into its spans (its K bytes, then its V bytes, in any
        number of pieces), writing them only inside `gate`, and check it against `dtype` and its shape;
        backends that can read straight into the spans override this."""
        for (layer, key), buf, payload, shape in zip(items, self._get(items), spans, shapes):
            name = self.object_name(key, layer)
            view = memoryview(buf).cast("B")
            object_format.check_size(name, view.nbytes, payload, shape, dtype)
            with gate.writing():  # the object is in our memory already: a bounded copy
                copy_into(view[object_format.HEADER_SIZE:], payload)
            object_format.check_payload(view[:object_format.HEADER_SIZE], payload, self.fingerprint, dtype, shape, name, key=key,
                                layer=layer)

    def _get_table(self, items: list[tuple[int, str]], table: SpanTable, shapes: list[tuple[int, ...]],
                   dtype: torch.dtype, gate: WriteGate) -> None:
        """_get_spans into a SpanTable's spans; backends with a reader that takes the table override this."""
        self._get_spans(items, table.views(), shapes, dtype, gate)
