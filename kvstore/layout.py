"""Which KV a process owns under tensor/pipeline parallelism, and how a chunk's parts are named and committed.

A store object holds one layer of one chunk for a contiguous range of KV heads: a writer *part*.
Under PP a rank owns a range of layers, under TP a range of KV heads of each of them (a rank whose
heads another rank already saves, a replica when TP exceeds the KV head count, writes nothing). So a
chunk written by a (TP, PP) node is the grid of parts {layer stage} x {head group}; each writer
writes its own part's objects and its part marker (named by the part: two layouts writing the same
chunk never count each other's parts), and the writer that finds every part marker
present writes the chunk's commit marker, which records the grid (`WriterLayout`). Only that
marker makes a chunk present, so a chunk whose writer died halfway never counts (the store's
sweep removes it like any other uncommitted chunk).

A writer may store each head group as several objects of at most `object_heads` heads (the store's
`heads_per_object`; the last object of a group may hold fewer): its *object groups*. A part is still
one writer stage x one writer head group, and the commit rule counts parts, never objects
(`part_objects` names the objects a part holds; both backends' commits ask it).

A reader of any layout reads, for each of its layers, the object groups that overlap its own heads
(`WriterLayout.reads`). Objects are layer-by-layer, so the writer's layer stages never matter to a
reader; when an object group is exactly the reader's heads (the same TP, or a single-process writer
read by a single-process reader), the read is the plain whole-object read straight into paged
memory. An object's payload is token-major ([2, n, heads, head_dim], what paged memory holds), so a
reader whose heads are a strict part of an object group reads that whole object and keeps its own
heads; a writer whose objects are no wider than the narrowest reader's heads spares every reader
that (docs/parallelism.md says what each costs).

The single-process layout names its objects and writes its markers exactly as before parts existed
(a whole-heads object is `<layer>`, its marker holds the layer count alone), so stores written
before stay readable and a single-process writer pays nothing for this. A marker records the object
grain only when it splits a group (`o=`), so markers written before decode to the same layouts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

Heads = tuple[int, int]
MAX_CHUNK_OBJECTS = 1 << 16  # layer objects a chunk may hold: a 126-layer model saved one object per head
                             # of 128 KV heads holds 16128. A marker claiming more is damage, never a list


@dataclass(frozen=True)
class KVShard:
    """The KV one rank owns: layers [layers[0], layers[1]) and KV heads [heads[0], heads[1]) of
    `num_kv_heads`; `writes` False for a replica whose heads another rank saves. `layer_starts` and
    `head_starts` are the first layer of every PP stage and the first head of every writing TP head
    group (the writer grid every rank of the node shares; the commit rule counts its parts).
    None/empty everywhere means the single-process layout: everything (`resolve` fills it in)."""

    rank: int = 0
    world: int = 1
    layers: tuple[int, int] | None = None
    heads: Heads | None = None
    num_kv_heads: int | None = None
    writes: bool = True
    layer_starts: tuple[int, ...] = (0,)
    head_starts: tuple[int, ...] = (0,)
    num_layers: int | None = None

    @classmethod
    def tp_pp(cls, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int, num_layers: int, num_kv_heads: int,
              stage_layers: list[tuple[int, int]] | None = None) -> KVShard:
        """The shard of TP rank `tp_rank` in PP stage `pp_rank` (global rank pp_rank * tp_size + tp_rank,
        vLLM's order). KV heads split evenly across TP ranks, or replicated tp_size // num_kv_heads times
        when TP exceeds them (vLLM's rule); `stage_layers` is each stage's [lo, hi) (default: vLLM's
        get_pp_indices, an even split whose remainder goes one layer each to the stages before the last)."""
        if tp_size < 1 or pp_size < 1 or not 0 <= tp_rank < tp_size or not 0 <= pp_rank < pp_size:
            raise ValueError(f"rank tp {tp_rank}/{tp_size}, pp {pp_rank}/{pp_size} is not a rank of that layout")
        if tp_size <= num_kv_heads:
            if num_kv_heads % tp_size:
                raise ValueError(f"{num_kv_heads} KV heads do not split over TP {tp_size}")
            per = num_kv_heads // tp_size
            heads, writes, starts = (tp_rank * per, (tp_rank + 1) * per), True, tuple(range(0, num_kv_heads, per))
        else:
            if tp_size % num_kv_heads:
                raise ValueError(f"TP {tp_size} is not a multiple of the {num_kv_heads} KV heads it replicates")
            replicas = tp_size // num_kv_heads
            head = tp_rank // replicas
            heads, writes, starts = (head, head + 1), tp_rank % replicas == 0, tuple(range(num_kv_heads))
        if stage_layers is None:
            base, extra = divmod(num_layers, pp_size)
            sizes = [base] * pp_size
            for i in range(2, extra + 2):
                sizes[-i] += 1
            stage_layers = [(sum(sizes[:i]), sum(sizes[:i + 1])) for i in range(pp_size)]
        if len(stage_layers) != pp_size or stage_layers[0][0] != 0 or stage_layers[-1][1] != num_layers or \
                any(a[1] != b[0] for a, b in zip(stage_layers, stage_layers[1:])) or \
                any(lo >= hi for lo, hi in stage_layers):
            raise ValueError(f"stage layers {stage_layers} do not cover {num_layers} layers in {pp_size} stages")
        return cls(rank=pp_rank * tp_size + tp_rank, world=tp_size * pp_size, layers=stage_layers[pp_rank],
                   heads=heads, num_kv_heads=num_kv_heads, writes=writes,
                   layer_starts=tuple(lo for lo, _ in stage_layers), head_starts=starts, num_layers=num_layers)

    def resolve(self, num_layers: int, num_kv_heads: int) -> KVShard:
        """This shard with every default filled in for a model of num_layers layers and num_kv_heads heads."""
        if self.num_kv_heads not in (None, num_kv_heads) or self.num_layers not in (None, num_layers):
            raise ValueError(f"shard of {self.num_layers} layers x {self.num_kv_heads} KV heads for a model "
                             f"with {num_layers} x {num_kv_heads}")
        layers = self.layers or (0, num_layers)
        heads = self.heads or (0, num_kv_heads)
        if not 0 <= layers[0] < layers[1] <= num_layers or not 0 <= heads[0] < heads[1] <= num_kv_heads:
            raise ValueError(f"shard layers {layers} / heads {heads} outside {num_layers} layers / "
                             f"{num_kv_heads} heads")
        shard = KVShard(self.rank, self.world, layers, heads, num_kv_heads, self.writes, self.layer_starts,
                        self.head_starts, num_layers)
        shard.layout(num_layers)  # ValueError for a grid this shard is not a part of
        return shard

    def layout(self, num_layers: int) -> WriterLayout:
        """The writer grid this rank's node saves with."""
        layout = WriterLayout(num_layers, self.num_kv_heads or 0, self.layer_starts, self.head_starts)
        if self.layers is not None and self.heads is not None and self.writes:
            layout.part_index(self.layers, self.heads)  # ValueError unless a part of the grid
        return layout

    @property
    def heads_range(self) -> Heads:
        assert self.heads is not None, "resolve() the shard first"
        return self.heads

    @property
    def layer_range(self) -> range:
        assert self.layers is not None, "resolve() the shard first"
        return range(*self.layers)

    def describe(self) -> str:
        return f"rank {self.rank}/{self.world}: layers [{self.layers[0]}, {self.layers[1]}), KV heads " \
               f"[{self.heads[0]}, {self.heads[1]}) of {self.num_kv_heads}{'' if self.writes else ' (replica)'}" \
            if self.layers and self.heads else f"rank {self.rank}/{self.world}: everything"


@dataclass(frozen=True)
class WriterLayout:
    """What a chunk's commit marker records: the grid of parts its writer node saved (layer stages
    starting at `layer_starts`, head groups starting at `head_starts`), its codec, and how many heads
    each object holds at most (`object_heads`; 0: one object per head group)."""

    num_layers: int
    num_kv_heads: int = 0  # 0: the single-process layout, whatever the model's head count
    layer_starts: tuple[int, ...] = (0,)
    head_starts: tuple[int, ...] = (0,)
    codec: str = "raw"  # what the writer's store encodes payloads with (kvstore/payload_codecs.py)
    object_heads: int = 0  # the store's heads_per_object; 0 whenever it splits no head group

    def __post_init__(self) -> None:
        if self.num_layers < 1 or not _valid_starts(self.layer_starts, self.num_layers):
            raise ValueError(f"layer stages {self.layer_starts} of {self.num_layers} layers")
        if self.head_starts != (0,) and not _valid_starts(self.head_starts, self.num_kv_heads):
            raise ValueError(f"head groups {self.head_starts} of {self.num_kv_heads} heads")
        if self.object_heads < 0:
            raise ValueError(f"heads per object {self.object_heads} is negative")
        if self.object_heads:
            if not self.num_kv_heads:
                raise ValueError("heads per object needs the layout's KV head count")
            if all(hi - lo <= self.object_heads for lo, hi in self.head_groups(self.num_kv_heads)):
                object.__setattr__(self, "object_heads", 0)  # splits nothing: the layout (and marker) of before
        if self.num_objects() > MAX_CHUNK_OBJECTS:  # counted, not listed: a marker's numbers size nothing
            raise ValueError(f"{self.num_layers} layers x {self.num_objects() // self.num_layers} objects: more "
                             f"than the {MAX_CHUNK_OBJECTS} layer objects a chunk may hold")

    @property
    def single(self) -> bool:
        """One part holding every layer and head: the single-process layout."""
        return self.layer_starts == (0,) and self.head_starts == (0,)

    @property
    def plain(self) -> bool:
        """The single-process layout with raw payloads: the marker of stores from before layouts and codecs."""
        return self.single and self.codec == "raw" and not self.object_heads

    def head_groups(self, num_kv_heads: int) -> list[Heads]:
        ends = (*self.head_starts[1:], num_kv_heads)
        return list(zip(self.head_starts, ends))

    def stages(self) -> list[tuple[int, int]]:
        return list(zip(self.layer_starts, (*self.layer_starts[1:], self.num_layers)))

    def parts(self, num_kv_heads: int) -> list[tuple[tuple[int, int], Heads]]:
        """Every part: ((layer lo, hi), (head lo, hi)), stage-major."""
        return [(stage, group) for stage in self.stages() for group in self.head_groups(num_kv_heads)]

    def part_index(self, layers: tuple[int, int], heads: Heads) -> int:
        heads_total = self.num_kv_heads or heads[1]
        for i, part in enumerate(self.parts(heads_total)):
            if part == (tuple(layers), tuple(heads)):
                return i
        raise ValueError(f"layers {layers} x heads {heads} is no part of the grid {self.encode()}")

    def part_names(self, num_kv_heads: int) -> list[str]:
        """Each part's marker suffix, named by what it holds (`<lo>-<hi>.h<a>-<b>`), so the markers of two
        layouts sharing a chunk never stand in for each other's parts."""
        return [f"{lo}-{hi}.h{a}-{b}" for (lo, hi), (a, b) in self.parts(num_kv_heads)]

    def num_parts(self) -> int:
        return len(self.layer_starts) * len(self.head_starts)

    def num_objects(self) -> int:
        """How many layer objects a chunk of this layout holds (len(object_layers(...))), computed without
        listing them."""
        per_layer = sum(-(-(hi - lo) // self.object_heads) if self.object_heads else 1
                        for lo, hi in self.head_groups(self.num_kv_heads))
        return self.num_layers * per_layer

    def object_groups(self, num_kv_heads: int) -> list[Heads]:
        """The KV heads of each object of a layer, in head order: each head group split by object_heads."""
        return [obj for group in self.head_groups(num_kv_heads) for obj in split_heads(group, self.object_heads)]

    def object_layers(self, num_kv_heads: int) -> list[int | str]:
        """The object name of every layer object of a chunk written with this layout."""
        groups = self.object_groups(num_kv_heads)
        return [object_layer(layer, group, num_kv_heads) for layer in range(self.num_layers) for group in groups]

    def part_objects(self, part: int, num_kv_heads: int) -> list[int | str]:
        """The object names part `part` holds (its stage's layers x its head group's objects): what a
        writer of that part must have written before it commits the part."""
        (lo, hi), group = self.parts(num_kv_heads)[part]
        objects = split_heads(group, self.object_heads)
        return [object_layer(layer, obj, num_kv_heads) for layer in range(lo, hi) for obj in objects]

    def reads(self, heads: Heads, num_kv_heads: int) -> list[tuple[Heads, Heads]]:
        """What a reader of KV heads `heads` reads of each layer: (object group, the part of it that is the
        reader's), in head order; one item equal to (heads, heads) is the plain whole read."""
        out = []
        for group in self.object_groups(num_kv_heads):
            lo, hi = max(group[0], heads[0]), min(group[1], heads[1])
            if lo < hi:
                out.append((group, (lo, hi)))
        return out

    def fitting_object_heads(self, heads: Heads, num_kv_heads: int) -> int:
        """The largest heads_per_object with which a reader of `heads` would read its own heads only: the
        gcd of its bounds' offsets inside the writer head groups they cut (0: it reads no other heads)."""
        offsets = [bound - lo for bound in heads for lo, hi in self.head_groups(num_kv_heads) if lo < bound < hi]
        return math.gcd(*offsets)

    def encode(self) -> str:
        """The marker text: the layer count alone for the plain layout (as before parts and codecs existed)."""
        if self.plain:
            return str(self.num_layers)
        grain = f";o={self.object_heads}" if self.object_heads else ""  # markers that split nothing stay as before
        return f"{self.num_layers};H={self.num_kv_heads};l={','.join(map(str, self.layer_starts))};" \
               f"h={','.join(map(str, self.head_starts))};c={self.codec}{grain}"

    @classmethod
    def decode(cls, text: str) -> WriterLayout:
        """ValueError for anything that is not a marker's text."""
        if text.isdigit():
            return cls(int(text))
        fields = text.split(";")
        names = ["H=", "l=", "h=", "c=", "o="][:len(fields) - 1]
        if len(fields) not in (5, 6) or not fields[0].isdigit() or [f[:2] for f in fields[1:]] != names \
                or fields[4][2:] not in ("raw", "lossless", "int8", "fp8") \
                or (len(fields) == 6 and not fields[5][2:].isdigit()):
            raise ValueError(f"not a commit marker: {text[:80]!r}")
        try:
            layout = cls(int(fields[0]), int(fields[1][2:]), tuple(int(x) for x in fields[2][2:].split(",")),
                         tuple(int(x) for x in fields[3][2:].split(",")), fields[4][2:],
                         int(fields[5][2:]) if len(fields) == 6 else 0)
        except ValueError as exc:
            raise ValueError(f"not a commit marker: {text[:80]!r}") from exc
        if len(fields) == 6 and not layout.object_heads:  # a writer records o= only when it splits
            raise ValueError(f"not a commit marker: {text[:80]!r}")
        return layout


def _valid_starts(starts: tuple[int, ...], total: int) -> bool:
    return bool(starts) and starts[0] == 0 and all(a < b for a, b in zip(starts, starts[1:])) and starts[-1] < total


def split_heads(group: Heads, per_object: int) -> list[Heads]:
    """The objects a writer stores head group `group` as: runs of `per_object` heads from its first head,
    the last one possibly shorter (per_object 0, or no smaller than the group: the group whole)."""
    lo, hi = group
    if per_object <= 0 or hi - lo <= per_object:
        return [(lo, hi)]
    return [(a, min(a + per_object, hi)) for a in range(lo, hi, per_object)]


def object_layer(layer: int, heads: Heads | None, num_kv_heads: int | None) -> int | str:
    """How a layer object is named: the layer alone when it holds every head (the single-process
    layout's name, unchanged), `<layer>.h<lo>-<hi>` for a head group."""
    if heads is None or num_kv_heads is None or tuple(heads) == (0, num_kv_heads):
        return layer
    return f"{layer}.h{heads[0]}-{heads[1]}"


def parse_object_layer(text: str) -> int | str | None:
    """The inverse of object_layer for a name's text; None when it is no layer object's name."""
    if text.isdigit():
        return int(text)
    layer, sep, heads = text.partition(".h")
    lo, dash, hi = heads.partition("-")
    if sep and dash and layer.isdigit() and lo.isdigit() and hi.isdigit() and int(lo) < int(hi):
        return text
    return None


def layer_number(layer: int | str) -> int:
    """The layer index of an object name (int or `<layer>.h<lo>-<hi>`)."""
    return layer if isinstance(layer, int) else int(str(layer).partition(".")[0])


def first_layer(layer: int | str) -> bool:
    """Whether an object name is one of layer 0 (a load of it advances its chunk's LRU clock)."""
    return layer == 0 or (isinstance(layer, str) and layer.startswith("0."))


class LayoutCache:
    """Chunk key -> the layout its commit marker records, as this process's lookups read them: the load that
    usually follows a lookup needs them (recent chunks only)."""

    LIMIT = 8192

    def __init__(self) -> None:
        self._layouts: dict[str, WriterLayout] = {}

    def remember(self, pairs: list[tuple[str, WriterLayout]]) -> None:
        if len(self._layouts) > self.LIMIT:
            self._layouts.clear()
        self._layouts.update(pairs)

    def get(self, keys: Sequence[str]) -> list[WriterLayout | None]:
        return [self._layouts.get(key) for key in keys]
