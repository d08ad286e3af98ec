"""The read half of a KV store: layers of chunks into fresh tensors, reused buffers or paged KV blocks.

`LayerReader` is the reads member of kvstore.base.KVStore; kvstore/base.py's docstring is the API. It
reads through the narrow `ObjectReads` interface every backend implements (whole objects, and payloads
into spans), so the same checks run over files and redis: every read checks each object (header, key
binding, xxh3) where it landed before the call returns. Backends that read straight into the
destination implement `_get_spans` / `_get_table` themselves (kvstore/fs_read.py, kvstore/redis_store.py);
`copy_into_spans` is the read of the others: whole objects, then a bounded copy inside the gate.

Batched loads (the decode hot path: all chunks of a prompt, many layers, one call)::

    # staging: per layer one reusable (pinned) buffer [2, T, H, D] holding the chunks in token order
    out = [[staging[i][:, a:b] for a, b in chunk_token_ranges] for i in range(num_layers)]
    futures = store.get_layers_async(range(num_layers), keys, out=out)   # one Future per layer
    for i, fut in enumerate(futures):
        store.result(fut, remaining_s)       # layer i complete (StoreError / StoreTimeout otherwise)
        scatter(staging[i][:, lo:hi], slots)  # one copy per layer into paged memory

  get_layers(layers, keys, out=None) -> list[list[Tensor]]  (result[i][j]: layer layers[i] of keys[j])
      Reads every (layer, chunk) object in one call: one pipelined round trip on redis (on a
      cluster: one pipeline per node, sent to all nodes before any reply is read).
  get_layers_async(layers, keys, out=None) -> list[Future]  (future i -> get_layers' row i)
      One task per layer on the store's I/O pool, queued in `layers` order, so early layers
      finish first and several layers are read at once (io_threads parallel connections on
      redis). A future that has not started can be cancel()ed (e.g. after an earlier layer
      failed: the request recomputes anyway).
  out[i][j] is the destination of layer layers[i] of chunk keys[j]: a CPU tensor (pinned or not)
      of the store's dtype and shape [2, n_tokens_j, H, D] whose K half and V half are each
      contiguous, e.g. a token slice staging[:, a:b] of a [2, T, H, D] buffer. Files are read
      straight into it (readv, no intermediate copy); redis replies are copied into it. The
      returned tensors are those `out` tensors. Without `out`, fresh tensors are returned
      (aliasing the reply bytes on redis: read-only, no copy). Either way every object's
      header, key binding and xxh3 checksum are checked before its future resolves; an error
      in any object fails that layer's call/future (NotFound, CorruptObject, ...).
"""
from __future__ import annotations

import concurrent.futures
import time
from typing import Callable, Protocol, Sequence

import torch

from pdserve.kvstore import object_format
from pdserve.kvstore.binding import ModelBinding
from pdserve.kvstore.calls import StoreCalls
from pdserve.kvstore.gate import NO_GATE, WriteGate
from pdserve.kvstore.layout import Heads
from pdserve.kvstore.records import Buffer
from pdserve.kvstore.spans import SpanTable, copy_into


class ObjectReads(Protocol):
    """The backend reads a layer read makes (kvstore/base.py's read hooks)."""

    def object_name(self, key: str, layer: int | str) -> str: ...

    def _get(self, items: list[tuple[int | str, str]]) -> list[Buffer]: ...

    def _get_spans(self, items: list[tuple[int | str, str]], spans: list[list[memoryview]],
                   shapes: list[tuple[int, ...]], dtype: torch.dtype, gate: WriteGate = NO_GATE) -> None: ...

    def _get_table(self, items: list[tuple[int | str, str]], table: SpanTable, shapes: list[tuple[int, ...]],
                   dtype: torch.dtype, gate: WriteGate) -> None: ...


class LayerReader:
    """get_layer, get_layer_into, get_layer_spans, get_layers, get_layers_async and get_layer_decoded of a
    store: checked against its `model`, read through its `backend`, made and counted through its `calls`;
    `submit` runs a layer's read on the store's I/O pool."""

    def __init__(self, model: ModelBinding, backend: ObjectReads, calls: StoreCalls,
                 submit: Callable[..., concurrent.futures.Future]) -> None:
        self._model = model
        self._backend = backend
        self._calls = calls
        self._submit = submit

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
        self._model.check(layer)
        name, kv_shape = self._model.part(layer, heads)
        if len(chunk_lens) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(chunk_lens)} chunk lengths")
        if staging.device.type != "cpu" or not staging.is_contiguous() or staging.dim() != 4 or \
                staging.shape[0] != 2 or staging.shape[1] != sum(chunk_lens):
            raise ValueError(f"staging must be a contiguous CPU tensor [2, {sum(chunk_lens)}, H, D], "
                             f"got {list(staging.shape)}")
        if self._model.dtype is not None and staging.dtype != self._model.dtype:
            raise ValueError(f"staging tensor of dtype {staging.dtype}, store holds {self._model.dtype}")
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
        self._calls.guard(self._backend._get_spans, [(name, key) for key in keys], spans, shapes, staging.dtype)
        self._calls.count(objects_read=len(keys), bytes_read=object_format.HEADER_SIZE * len(keys) + whole.nbytes,
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
        self._model.check(layer)
        name, kv_shape = self._model.part(layer, heads)
        if self._model.dtype is None or self._model.kv_shape is None:
            raise ValueError("get_layer_spans needs a store opened with dtype and kv_shape")
        if not len(spans) == len(chunk_lens) == len(keys):
            raise ValueError(f"{len(keys)} keys, {len(spans)} span lists and {len(chunk_lens)} chunk lengths")
        start = time.perf_counter()
        shapes = [(2, n, *kv_shape) for n in chunk_lens]
        items = [(name, key) for key in keys]
        if isinstance(spans, SpanTable):
            self._calls.guard(self._backend._get_table, items, spans, shapes, self._model.dtype, gate)
        else:
            self._calls.guard(self._backend._get_spans, items, [list(row) for row in spans], shapes, self._model.dtype, gate)
        nbytes = 2 * sum(chunk_lens) * kv_shape[0] * kv_shape[1] * self._model.dtype.itemsize  # checked per object
        self._calls.count(objects_read=len(keys), bytes_read=object_format.HEADER_SIZE * len(keys) + nbytes,
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
        return [self._submit(self._read_layer, layer, keys, None if out is None else list(out[i]))
                for i, layer in enumerate(layers)]

    def get_layer_decoded(self, layer: int, keys: Sequence[str], heads: Heads | None = None
                          ) -> tuple[list[torch.Tensor], int, set[str]]:
        """Layer `layer` of several chunks (their `heads` group's objects), each decoded by the codec its
        header names into a fresh tensor: (tensors, the objects' stored bytes, the codecs seen). The read of
        chunks another layout or a codec wrote (connectors/store_connector.py)."""
        keys = list(keys)
        self._model.check(layer)
        name, kv_shape = self._model.part(layer, heads)
        items = [(name, key) for key in keys]
        start = time.perf_counter()
        buffers = self._calls.guard(self._backend._get, items)
        views = [memoryview(buf).cast("B") for buf in buffers]
        tensors = [self._calls.guard(object_format.decode, view, self._model.fingerprint, self._model.dtype, kv_shape,
                               self._backend.object_name(key, name), key=key, layer=name) for key, view in zip(keys, views)]
        stored = sum(view.nbytes for view in views)
        self._calls.count(objects_read=len(items), bytes_read=stored, read_seconds=time.perf_counter() - start)
        return tensors, stored, {object_format.codec_of(view) for view in views}

    def _read_layer(self, layer: int, keys: list[str], out: list[torch.Tensor] | None) -> list[torch.Tensor]:
        return self._read([layer], keys, None if out is None else [out])[0]

    def _read(self, layers: list[int], keys: list[str], out: Sequence[Sequence[torch.Tensor]] | None,
              heads: Heads | None = None) -> list[list[torch.Tensor]]:
        """get_layers after its argument checks."""
        kv_shape = self._model.part(0, heads)[1]
        items = [(self._model.part(layer, heads)[0], key) for layer in layers for key in keys]
        start = time.perf_counter()
        if out is None:
            buffers = self._calls.guard(self._backend._get, items)
            flat = [self._calls.guard(object_format.decode, buf, self._model.fingerprint, self._model.dtype, kv_shape,
                                self._backend.object_name(key, layer), key=key, layer=layer)
                    for (layer, key), buf in zip(items, buffers)]
        else:
            flat = [t for row in out for t in row]
            self._calls.guard(self._get_into, items, flat)
        self._calls.count(objects_read=len(items), bytes_read=sum(object_format.HEADER_SIZE + t.nbytes for t in flat),
                    read_seconds=time.perf_counter() - start)
        return [flat[i * len(keys):(i + 1) * len(keys)] for i in range(len(layers))]

    def _check_request(self, layers: list[int], keys: list[str],
                       out: Sequence[Sequence[torch.Tensor]] | None) -> None:
        for layer in layers:
            self._model.check(layer)
        self._model.check()
        if out is None:
            return
        if len(out) != len(layers):
            raise ValueError(f"{len(layers)} layers but {len(out)} rows of output tensors")
        for row in out:
            if len(row) != len(keys):
                raise ValueError(f"{len(keys)} keys but {len(row)} output tensors")
            for tensor in row:
                if self._model.dtype is not None and tensor.dtype != self._model.dtype:
                    raise ValueError(f"output tensor of dtype {tensor.dtype}, store holds {self._model.dtype}")
                object_format.payload_views(tensor)  # ValueError unless a CPU tensor with contiguous K and V halves

    def _get_into(self, items: list[tuple[int | str, str]], out: list[torch.Tensor]) -> None:
        """Fill preallocated tensors (each K and V half contiguous)."""
        self._backend._get_spans(items, [object_format.payload_views(t) for t in out], [tuple(t.shape) for t in out],
                        out[0].dtype if out else torch.uint8)


def copy_into_spans(backend: ObjectReads, fingerprint: str | None, items: list[tuple[int | str, str]],
                    spans: list[list[memoryview]], shapes: list[tuple[int, ...]], dtype: torch.dtype,
                    gate: WriteGate = NO_GATE) -> None:
    """Read each (layer, key) object whole and copy its payload into its spans (its K bytes, then its V bytes,
    in any number of pieces), writing them only inside `gate`, and check it against `dtype` and its shape:
    the `_get_spans` of a backend that cannot read straight into the spans."""
    for (layer, key), buf, payload, shape in zip(items, backend._get(items), spans, shapes):
        name = backend.object_name(key, layer)
        view = memoryview(buf).cast("B")
        object_format.check_size(name, view.nbytes, payload, shape, dtype)
        with gate.writing():  # the object is in our memory already: a bounded copy
            copy_into(view[object_format.HEADER_SIZE:], payload)
        object_format.check_payload(view[:object_format.HEADER_SIZE], payload, fingerprint, dtype, shape, name,
                                    key=key, layer=layer)
