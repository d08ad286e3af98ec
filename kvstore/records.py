"""What a KV store returns besides tensors: its counters, usage per fingerprint, chunk listings, verify reports."""
from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.kvstore.object_format import header_codec


def _count_codec(counts: dict[str, int], codec: str, nbytes: int) -> None:
    counts[codec] = counts.get(codec, 0) + nbytes

Buffer = bytes | bytearray | memoryview  # an object's raw bytes as a backend returns them


@dataclass
class StoreStats:
    """This process's counters since the store was opened."""

    lookups: int = 0
    lookup_chunks: int = 0
    hit_chunks: int = 0
    objects_written: int = 0
    bytes_written: int = 0
    write_seconds: float = 0.0
    objects_read: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0
    chunks_committed: int = 0
    chunks_deleted: int = 0
    errors: int = 0


@dataclass
class Usage:
    """What one model fingerprint occupies in the backend."""

    chunks: int = 0  # committed chunks
    objects: int = 0  # layer objects (committed or not)
    bytes: int = 0  # bytes of layer objects: committed + in-flight + orphaned
    committed_bytes: int = 0
    inflight_chunks: int = 0  # uncommitted chunks a writer may still be saving
    inflight_bytes: int = 0
    orphaned_chunks: int = 0  # uncommitted chunks nobody writes any more (a failed save, a dead writer)
    orphaned_bytes: int = 0
    codec_bytes: dict[str, int] = field(default_factory=dict)  # bytes of layer objects by codec (kvstore/payload_codecs.py)
    raw_bytes: int = 0  # what those objects' tensors would take raw

    @property
    def compression_ratio(self) -> float:
        """raw bytes / stored bytes of the layer objects (1.0: all raw)."""
        return self.raw_bytes / self.bytes if self.bytes else 1.0


@dataclass
class ChunkInfo:
    fingerprint: str
    key: str
    committed: bool
    objects: int  # layer objects present
    bytes: int
    orphaned: bool = False  # uncommitted and untouched long enough that no writer is saving it
    codec_bytes: dict[str, int] = field(default_factory=dict)  # its objects' bytes by codec
    raw_bytes: int = 0  # what its objects' tensors would take raw

    def count_object(self, nbytes: int, header: bytes) -> None:
        """Add one layer object of `nbytes` whose first bytes are `header` (kvstore.object_format.header_codec)."""
        codec, raw = header_codec(header)
        self.objects += 1
        self.bytes += nbytes
        self.raw_bytes += raw
        _count_codec(self.codec_bytes, codec, nbytes)


@dataclass
class VerifyReport:
    objects: int = 0
    bytes: int = 0
    corrupt: list[str] = field(default_factory=list)  # "<name>: <reason>" per bad object
    damaged: list[str] = field(default_factory=list)  # "<fingerprint>/<key>: <reason>" per damaged committed chunk
    repaired: int = 0  # damaged chunks un-committed (verify(repair=True))
