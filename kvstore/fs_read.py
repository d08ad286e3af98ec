"""The file store's reads into caller memory: a load's objects straight into paged KV blocks.

`FileReader` is the reads member of kvstore.filesystem.FileSystemStore: whole objects, and payloads
into caller spans (the store's read hooks, kvstore/reads.py's ObjectReads). A load's bytes reach its spans only inside its write
gate (kvstore.gate), and nothing inside the gate waits for the medium: what the page cache holds is
read straight into the spans with RWF_NOWAIT; the rest, or everything on a filesystem without
RWF_NOWAIT (NFS), is read into scratch memory outside the gate and copied in inside it.

With the compiled reader (kvstore/native_reader.py, `span_reader`) a whole layer is one call with the GIL
released: opens and size checks, the page-cache reads of every object into its header and spans
inside the gate, each hashed while in cache, and the header and digest compares. An object that
is not plainly right there (not all in the page cache, damaged, of another chunk) comes back open
and goes through the Python path below, which finishes it or says precisely what is wrong.
"""
from __future__ import annotations

import errno
import logging
import os

import numpy as np
import torch

from pdserve.kvstore import object_format
from pdserve.kvstore.binding import ModelBinding
from pdserve.kvstore.errors import CorruptObject
from pdserve.kvstore.fs_tree import ChunkTree
from pdserve.kvstore.gate import NO_GATE, LoadAbandoned, WriteGate
from pdserve.kvstore.layout import first_layer
from pdserve.kvstore.native_reader import ReaderSlot
from pdserve.kvstore.records import Buffer
from pdserve.kvstore.spans import SpanTable, advance, copy_into, scratch_table

logger = logging.getLogger(__name__)


class FileReader:
    """Reads of the objects in `tree` (of the model of `model`), with the compiled reader `span_readers` holds
    where there is one; a read of a chunk's layer 0 advances its LRU clock."""

    def __init__(self, tree: ChunkTree, model: ModelBinding, span_readers: ReaderSlot) -> None:
        self._tree = tree
        self._model = model
        self._span_readers = span_readers
        self.nowait = hasattr(os, "RWF_NOWAIT")  # whether the filesystem takes RWF_NOWAIT reads (cleared the
                                                 # first time it refuses one)
        self._objects_seen: dict[tuple, tuple[str, bytes]] = {}  # (key, shape, dtype, fingerprint): (directory,
                                                                  # header head), layer_objects

    def get_objects(self, items: list[tuple[int | str, str]]) -> list[Buffer]:
        buffers: list[Buffer] = []
        for layer, key in items:
            buffers.append(read_file(f"{self._tree.chunk_dir(key)}/{layer}.kv"))
            if first_layer(layer):
                self._tree.refresh(key)
        return buffers

    def get_spans(self, items: list[tuple[int, str]], spans: list[list[memoryview]], shapes: list[tuple[int, ...]],
                   dtype: torch.dtype, gate: WriteGate = NO_GATE) -> None:
        header = memoryview(bytearray(object_format.HEADER_SIZE))
        for (layer, key), payload, shape in zip(items, spans, shapes):
            chunk = self._tree.chunk_dir(key)
            path = f"{chunk}/{layer}.kv"
            nbytes = sum(span.nbytes for span in payload)
            fd = os.open(path, os.O_RDONLY)
            try:
                object_format.check_size(path, os.fstat(fd).st_size, payload, shape, dtype, nbytes)
                if gate is NO_GATE:
                    read_exact(fd, [header, *payload], path)
                else:
                    self.read_gated(fd, [header, *payload], object_format.HEADER_SIZE + nbytes, path, gate)
            finally:
                os.close(fd)
            object_format.check_payload(header, payload, self._model.fingerprint, dtype, shape, path, key=key, layer=layer,
                                nbytes=nbytes)
            if first_layer(layer):
                self._tree.refresh(key)

    def get_table(self, items: list[tuple[int, str]], table: SpanTable, shapes: list[tuple[int, ...]],
                   dtype: torch.dtype, gate: WriteGate) -> None:
        """get_spans through the compiled reader: one call opens every object and checks its size (outside
        the gate), reads them from the page cache into their headers and spans and hashes each while it
        is in cache (inside the gate: no I/O wait), and compares headers and digests. An object not
        wholly in the page cache (or not right) takes the Python path for the rest of it, which says
        precisely what is wrong."""
        reader = self._span_readers.get()
        if reader is None or not self.nowait or gate is NO_GATE:
            return self.get_spans(items, table.views(), shapes, dtype, gate)
        fingerprint = self._model.fingerprint
        paths, expect = self.layer_objects(items, shapes, dtype)
        headers = np.empty(object_format.HEADER_SIZE * len(items), np.uint8)
        loaded = reader.load(paths, table.desc, table.first, table.bases(), headers, expect,
                             gate.native(reader.gate_close))
        if loaded.abandoned:
            raise LoadAbandoned("the load was abandoned; its destination is no longer written")
        if loaded.status == -errno.ENOENT:  # one is missing or of another size: nothing was read
            for path, fd, size, total, shape in zip(paths, loaded.fds.tolist(), loaded.sizes.tolist(), table.totals,
                                                    shapes):
                if size < 0:
                    raise OSError(-fd, os.strerror(-fd), path)  # FileNotFoundError for ENOENT
                object_format.check_size(path, size, [], shape, dtype, total)
        if loaded.status:
            raise OSError(-loaded.status, os.strerror(-loaded.status), paths[0])
        left = np.flatnonzero(loaded.fds >= 0).tolist()  # open: not plainly right yet
        try:
            if left:
                views, all_headers = table.views(), memoryview(headers)
                for i in left:
                    (layer, key), path, total = items[i], paths[i], table.totals[i]
                    header = all_headers[object_format.HEADER_SIZE * i:object_format.HEADER_SIZE * (i + 1)]
                    self.finish_object(int(loaded.fds[i]), int(loaded.got[i]), [header, *views[i]],
                                        object_format.HEADER_SIZE + total, path, gate)
                    object_format.check_payload(header, views[i], fingerprint, dtype, shapes[i], path, key=key, layer=layer,
                                        nbytes=total)
        finally:
            for i in left:
                os.close(int(loaded.fds[i]))
        for layer, key in items:
            if first_layer(layer):
                self._tree.refresh(key)

    def get_whole(self, items: list[tuple[int | str, str]], sizes: list[int], expect: bytes
                   ) -> tuple[list[memoryview], memoryview, list[int]] | None:
        """Coded objects of known payload sizes read whole by the compiled reader from the page cache into this
        thread's scratch, sized, hashed and their headers compared in one call (the batched coded load's read,
        kvstore/coded_reads.py); None without the reader, or when an object is missing, of another size, not
        wholly in the page cache or not as expected (the checked Python read then takes the layer)."""
        reader = self._span_readers.get()
        if reader is None or not self.nowait or not items:
            return None
        scratch, table, offsets = scratch_table(sizes)
        paths = [f"{self._tree.chunk_dir(key)}/{layer}.kv" for layer, key in items]
        headers = np.empty(object_format.HEADER_SIZE * len(items), np.uint8)
        loaded = reader.load(paths, table.desc, table.first, table.bases(), headers, expect, 0)
        left = np.flatnonzero(loaded.fds >= 0).tolist()
        for i in left:
            os.close(int(loaded.fds[i]))
        if loaded.status or left:
            return None
        for layer, key in items:
            if first_layer(layer):
                self._tree.refresh(key)
        return [scratch[a:b] for a, b in zip(offsets[:-1], offsets[1:])], memoryview(headers), loaded.digests.tolist()

    def layer_objects(self, items: list[tuple[int, str]], shapes: list[tuple[int, ...]], dtype: torch.dtype
                       ) -> tuple[list[str], bytes]:
        """Each object's path, and its expected header bytes [0, object_format.SUMMED) back to back (object_format.expected_header).
        A load asks for the same chunks layer after layer: each chunk's directory and its header up to the
        binding (the last 8 of those bytes, object_format's layout) are kept from its first layer for the others,
        which only hash their binding (a few microseconds less per object, on every layer)."""
        seen, fingerprint = self._objects_seen, self._model.fingerprint
        if len(seen) > 4096:  # the chunks of recent loads only
            seen.clear()
        paths, heads = [], []
        for (layer, key), shape in zip(items, shapes):
            known = seen.get((key, shape, dtype, fingerprint))
            if known is None:
                head = object_format.expected_header(fingerprint, dtype, shape, key=key, layer=layer)
                known = seen[key, shape, dtype, fingerprint] = (self._tree.chunk_dir(key), head[:-8])
            else:
                head = known[1] + object_format.binding(key, layer).to_bytes(8, "little")
            paths.append(f"{known[0]}/{layer}.kv")
            heads.append(head)
        return paths, b"".join(heads)

    def finish_object(self, fd: int, done: int, views: list[memoryview], total: int, path: str,
                       gate: WriteGate) -> None:
        """After the compiled reader read `done` bytes of an object (-errno: an error), the rest the
        Python way: gated RWF_NOWAIT reads, then cold reads into scratch."""
        if done < 0:
            if -done not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise OSError(-done, os.strerror(-done), path)
            done = 0
        if done < total:
            self.read_gated(fd, advance(views, done), total - done, path, gate, done)

    def read_gated(self, fd: int, views: list[memoryview], total: int, path: str, gate: WriteGate,
                    start: int = 0) -> None:
        """Fill the views, writing them only inside `gate` (kvstore.gate): what the page cache holds is
        read straight into them with RWF_NOWAIT (a copy that never waits for the medium); the rest,
        or everything where the filesystem has no RWF_NOWAIT (NFS), is read into scratch memory
        outside the gate, however long that takes, and then copied in inside it. `total`: the views' bytes;
        `start`: the file offset they begin at."""
        got = 0
        if self.nowait:
            gate.enter()
            try:
                while got < total:
                    try:
                        n = os.preadv(fd, views, start + got, os.RWF_NOWAIT)
                    except BlockingIOError:  # not (all) in the page cache: read the rest outside the gate
                        break
                    except OSError as exc:
                        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                            raise
                        self.nowait = False
                        logger.info("KV store %s: no RWF_NOWAIT reads here (%s); loads copy through scratch "
                                    "memory", self._tree.root, exc.strerror)
                        break
                    if n == 0:
                        raise CorruptObject(f"{path}: file ended after {start + got} of {start + total} bytes")
                    got += n
                    if got < total:
                        views = advance(views, n)
            finally:
                gate.leave()
        if got < total:
            views = [v for v in views if v.nbytes]
            scratch = self.read_cold(fd, total - got, start + got, path)
            with gate.writing():
                copy_into(scratch, views)

    def read_cold(self, fd: int, nbytes: int, offset: int, path: str) -> memoryview:
        """Bytes [offset, offset + nbytes) of an object in fresh scratch memory: the read that may wait
        for the medium (a cold page cache, a hung NFS server), so it never writes a caller's spans."""
        scratch = memoryview(bytearray(nbytes))
        read_exact(fd, [scratch], path, offset=offset)
        return scratch


def read_file(path: str) -> bytearray:
    """Whole file into a fresh writable buffer (decoded copy-free by torch.frombuffer)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = bytearray(os.fstat(fd).st_size)
        got = read_exact(fd, [memoryview(buf)], path, strict=False)
        return buf if got == len(buf) else buf[:got]  # short: decode reports the length mismatch
    finally:
        os.close(fd)


def read_exact(fd: int, views: list[memoryview], path: str, strict: bool = True, offset: int | None = None) -> int:
    """Fill the views from fd (readv, or preadv from `offset`, resuming after short reads); CorruptObject
    if the file ends early and `strict`, else the number of bytes read."""
    views = [v for v in views if v.nbytes]
    total = sum(v.nbytes for v in views)
    got = 0
    while views:
        n = os.readv(fd, views) if offset is None else os.preadv(fd, views, offset + got)
        if n == 0:
            if strict:
                raise CorruptObject(f"{path}: file ended after {got} of {total} bytes")
            return got
        got += n
        views = advance(views, n)
    return got
