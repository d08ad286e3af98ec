"""One line per request for a KV hand-off split over ranks (docs/parallelism.md, "The engine's side of the
hand-off"): a rank's part of a load or a save (`KVTransfer`), and rank 0's join of the parts (`KVTransferJoin`).

Under TP/PP every rank's connector loads and saves its own part of a request's KV. The connectors' metrics
(connectors/kv_metrics.py) hand each load and save to a sink instead of writing its line; the ranks other
than 0 send theirs to rank 0 with their step report (kv_ranks.py), and rank 0 joins them with its own:
one load line per request load once every rank's part is in, one save line per (request, token range) once
every writing rank's part is in, with the whole node's figures (bytes summed, the slowest part's seconds,
every part's codec). Parts come in any order. A load that failed on any rank writes no load line (the
failing rank's warning and rank 0's fallback say it). A join still missing parts when no more can come (the
request's I/O ended everywhere) or past its deadline is written with what arrived and says so (a save
missing a writer's part committed nothing: its metrics write a save failure); the table of pending joins is
bounded.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

LOAD, SAVE = "load", "save"


@dataclass(frozen=True)
class KVTransfer:
    """One connector's load or save, as its metrics report it. Plain data: it travels to rank 0 as JSON."""

    kind: str  # LOAD or SAVE
    request_id: str
    num_bytes: int
    seconds: float
    codec: str | None = None  # a load's: the codec(s) its bytes were stored with, "+"-joined
    plan: tuple[int, ...] = (0, 0, 0, 0, 0)  # a load's LoadPlan: T, N, H, C, outputs (connectors/chunk_math.py)
    start: int = 0  # a save's prompt tokens [start, end) of num_tokens
    end: int = 0
    num_tokens: int = 0
    skip_leading_tokens: int = 0
    num_chunks: int = 0
    adapter: str | None = None  # the LoRA adapter's label (engine/lora/adapter.py) the KV was computed under

    @property
    def key(self) -> tuple[Any, ...]:
        """What the parts of one event share: a request's load (one at a time), a save's token range."""
        return (LOAD, self.request_id) if self.kind == LOAD else (SAVE, self.request_id, self.start, self.end)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> KVTransfer:
        return cls(**{**d, "plan": tuple(d["plan"])})


def joined(parts: Iterable[KVTransfer]) -> KVTransfer:
    """The parts of one event as one: bytes and chunks of every part, the slowest part's seconds (they run
    at once), every part's codec."""
    parts = list(parts)
    codecs = sorted({c for p in parts if p.codec for c in p.codec.split("+")})
    return replace(parts[0], num_bytes=sum(p.num_bytes for p in parts), seconds=max(p.seconds for p in parts),
                   codec="+".join(codecs) or None, num_chunks=max(p.num_chunks for p in parts))


# Writes a joined event's line and counters; the second argument is (parts arrived, parts expected) when
# some part never came, None for a whole event.
Emit = Callable[[KVTransfer, tuple[int, int] | None], None]


@dataclass
class _Join:
    expected: frozenset[int]
    deadline: float
    parts: dict[int, KVTransfer] = field(default_factory=dict)
    failed: set[int] = field(default_factory=set)  # ranks whose part of this load failed
    rounds: int = 0  # report rounds seen since the first part came


class KVTransferJoin:
    """Rank 0's join of every rank's part of each load and save."""

    # A part is late by the rank's own I/O deadline plus the step it is reported in: a join is given up at
    # its deadline only after this many report rounds too, so one long step never cuts it short.
    MIN_ROUNDS = 2

    def __init__(self, world: int, writers: Iterable[int], emit: Emit, load_timeout_s: float,
                 save_timeout_s: float, max_pending: int = 4096, clock: Callable[[], float] = time.monotonic) -> None:
        self.expected = {LOAD: frozenset(range(world)), SAVE: frozenset(writers)}  # a replica saves nothing
        self.timeouts = {LOAD: load_timeout_s, SAVE: save_timeout_s}
        self.emit, self.max_pending, self.clock = emit, max_pending, clock
        self._pending: dict[tuple[Any, ...], _Join] = {}  # in arrival order: the oldest first

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, rank: int, event: KVTransfer) -> None:
        """Rank `rank`'s part of a load or save (a replica's empty save is not a part)."""
        if rank in self.expected[event.kind]:
            self._join(event.key, event.kind).parts[rank] = event
            self._resolve(event.key)

    def load_failed(self, rank: int, request_id: str) -> None:
        """Rank `rank`'s part of the request's load failed: no load line for it, whatever the others did."""
        key = (LOAD, request_id)
        self._join(key, LOAD).failed.add(rank)
        self._resolve(key)

    def settle_load(self, request_id: str) -> None:
        """Every rank's load of the request ended (or the request finished): no more parts can come."""
        self._flush((LOAD, request_id))

    def settle_saves(self, request_id: str) -> None:
        """Every rank's saves of the finished request ended: no more parts can come."""
        for key in [k for k in self._pending if k[0] == SAVE and k[1] == request_id]:
            self._flush(key)

    def end_round(self) -> None:
        """After each step's reports: give up on the joins past their deadline."""
        now = self.clock()
        for key, join in list(self._pending.items()):
            join.rounds += 1
            if join.rounds >= self.MIN_ROUNDS and now >= join.deadline:
                self._flush(key)

    def _join(self, key: tuple[Any, ...], kind: str) -> _Join:
        join = self._pending.get(key)
        if join is None:
            while len(self._pending) >= self.max_pending:
                self._flush(next(iter(self._pending)))
            join = self._pending[key] = _Join(self.expected[kind], self.clock() + self.timeouts[kind])
        return join

    def _resolve(self, key: tuple[Any, ...]) -> None:
        """Write the event once every expected rank's part is in; drop a load once every rank answered and
        one failed."""
        join = self._pending[key]
        if join.expected <= join.parts.keys() | join.failed:
            del self._pending[key]
            if not join.failed:
                self.emit(joined(join.parts[r] for r in sorted(join.parts)), None)

    def _flush(self, key: tuple[Any, ...]) -> None:
        """No more parts will be waited for: write what arrived (a failed load: nothing)."""
        join = self._pending.pop(key, None)
        if join is not None and join.parts and not join.failed:
            self.emit(joined(join.parts[r] for r in sorted(join.parts)), (len(join.parts), len(join.expected)))
