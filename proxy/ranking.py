"""What a Router (proxy/router.py) keeps between requests, so that ranking one costs the same at 8 nodes or 1,024.

A router's members change seldom (a node joins, leaves, goes out of or back into rotation); their loads change
on every request. `LoadOrder` therefore rebuilds its picture of the members only after a membership or health
change (once, at the next ranking: O(n log n)), and follows a load change by moving one node between two
buckets (O(log n)). A ranking reads it lazily (`Ranking`): the caller takes the first node and walks further
only when a call fails, so a request pays for the few nodes it looks at, not for sorting the fleet.

Nodes tell the order about their changes through `watchers` (proxy/health.py: `Node.healthy` and the `NodeLoad`
fields behind `score`); a node without them (a test's stand-in) is read at each rebuild.
"""
from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from typing import Any, Callable, Iterable, Iterator, overload

Node = Any  # proxy.health.Node, or anything with address, healthy and load.score (the benchmarks' simulated nodes)


class Ranking(Sequence):
    """Nodes best first, computed as far as they are read: iterable in order, indexable, `len()` reads it all."""

    def __init__(self, nodes: Iterable[Node]) -> None:
        self._rest: Iterator[Node] | None = iter(nodes)
        self._got: list[Node] = []

    def _fill(self, n: int | None) -> None:
        while self._rest is not None and (n is None or len(self._got) < n):
            try:
                self._got.append(next(self._rest))
            except StopIteration:
                self._rest = None

    @overload
    def __getitem__(self, i: int) -> Node: ...

    @overload
    def __getitem__(self, i: slice) -> list[Node]: ...

    def __getitem__(self, i: int | slice) -> Node | list[Node]:
        if isinstance(i, slice) or i < 0:
            self._fill(None)
        else:
            self._fill(i + 1)
        return self._got[i]

    def __iter__(self) -> Iterator[Node]:
        i = 0
        while True:
            self._fill(i + 1)
            if i >= len(self._got):
                return
            yield self._got[i]
            i += 1

    def __len__(self) -> int:
        self._fill(None)
        return len(self._got)

    def __bool__(self) -> bool:
        self._fill(1)
        return bool(self._got)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"Ranking({[getattr(n, 'address', n) for n in self._got]}{', ...' if self._rest else ''})"

    def filter(self, keep: Callable[[Node], bool]) -> Ranking:
        """The nodes `keep` accepts, as lazily."""
        return Ranking(n for n in self if keep(n))


class Members(list):
    """A router's node list: the fleet appends and removes nodes as it always did; each change tells the order."""

    def __init__(self, nodes: Iterable[Node], changed: Callable[[], None]) -> None:
        super().__init__(nodes)
        self._changed = changed


def _mutator(name: str) -> Callable[..., Any]:
    base = getattr(list, name)

    def method(self: Members, *args: Any, **kwargs: Any) -> Any:
        out = base(self, *args, **kwargs)
        self._changed()
        return out
    method.__name__ = name
    return method


for _name in ("append", "extend", "insert", "remove", "pop", "clear", "sort", "reverse", "__setitem__",
              "__delitem__", "__iadd__", "__imul__"):
    setattr(Members, _name, _mutator(_name))


class LoadOrder:
    """The healthy members in rotation order (their list order), and their positions bucketed by load score."""

    def __init__(self) -> None:
        self.members: list[Node] = []
        self.dirty = True  # membership or health changed: rebuild at the next read
        self.version = 0  # any change (a lazy ranking that sees it move reads the rest afresh)
        self.generation = 0  # rebuilds (what the router's key groups are keyed by)
        self.healthy: list[Node] = []
        self.pos: dict[int, int] = {}  # id(node) -> its index in `healthy`
        self.score: dict[int, int] = {}  # id(node) -> the score its position is bucketed under
        self.buckets: dict[int, list[int]] = {}  # score -> positions, ascending
        self.scores: list[int] = []  # the buckets' scores, ascending
        self.by_address: dict[str, Node] = {}
        self._watched: dict[int, tuple[Node, Callable[[], None], Callable[[], None]]] = {}

    # ------------------------------------------------------------ changes
    def invalidate(self) -> None:
        self.dirty = True
        self.version += 1

    def _load_changed(self, node: Node) -> None:
        if self.dirty or (p := self.pos.get(id(node))) is None:
            return  # the rebuild reads it, or it is out of rotation
        key, new = id(node), node.load.score
        old = self.score[key]
        if new == old:
            return
        bucket = self.buckets[old]
        del bucket[bisect.bisect_left(bucket, p)]
        if not bucket:
            del self.buckets[old]
            self.scores.remove(old)
        if (bucket := self.buckets.get(new)) is None:
            bucket = self.buckets[new] = []
            bisect.insort(self.scores, new)
        bisect.insort(bucket, p)
        self.score[key] = new
        self.version += 1

    def _watch(self, node: Node) -> None:
        health: Callable[[], None] = self.invalidate

        def load() -> None:
            self._load_changed(node)
        if isinstance(getattr(node, "watchers", None), list):
            node.watchers.append(health)
        if isinstance(getattr(node.load, "watchers", None), list):
            node.load.watchers.append(load)
        self._watched[id(node)] = (node, health, load)

    def _unwatch(self, key: int) -> None:
        node, health, load = self._watched.pop(key)
        for watchers, fn in ((getattr(node, "watchers", None), health), (getattr(node.load, "watchers", None), load)):
            if isinstance(watchers, list) and fn in watchers:
                watchers.remove(fn)

    # ------------------------------------------------------------ reads
    def sync(self) -> None:
        """Rebuild after a membership or health change: O(n log n), once per change, not per request."""
        if not self.dirty:
            return
        members = {id(n): n for n in self.members}
        for key in [k for k in self._watched if k not in members]:
            self._unwatch(key)
        for key, node in members.items():
            if key not in self._watched:
                self._watch(node)
        self.healthy = [n for n in self.members if n.healthy]
        self.pos = {id(n): i for i, n in enumerate(self.healthy)}
        self.score = {id(n): n.load.score for n in self.healthy}
        self.buckets = {}
        for i, n in enumerate(self.healthy):  # ascending positions: each bucket is sorted as built
            self.buckets.setdefault(self.score[id(n)], []).append(i)
        self.scores = sorted(self.buckets)
        self.by_address = {n.address: n for n in self.healthy}
        self.dirty = False
        self.version += 1
        self.generation += 1

    def rotation(self, k: int) -> Iterator[Node]:
        """Round-robin: the healthy nodes from position k on, then the first k (a snapshot: a rebuild makes a new
        list)."""
        nodes = self.healthy
        return itertools.chain(itertools.islice(nodes, k, None), itertools.islice(nodes, k))

    def by_load(self, k: int) -> Iterator[Node]:
        """Least loaded first; equal scores in rotation order from position k (the round-robin that keeps equally
        loaded nodes taking turns). Valid only while `version` holds: `walk` stops reading it once it moves."""
        for score in self.scores:
            bucket = self.buckets[score]
            i = bisect.bisect_left(bucket, k)
            for j in itertools.chain(range(i, len(bucket)), range(i)):
                yield self.healthy[bucket[j]]

    def key(self, node: Node, k: int) -> tuple[int, int]:
        """(score, rotation distance): the order `by_load(k)` yields nodes in."""
        return self.score[id(node)], (self.pos[id(node)] - k) % len(self.healthy)

    def walk(self, k: int, first: list[Node], depth: dict[str, int] | None = None) -> Iterator[Node]:
        """`first` (the index's candidates, best first), then the rest least loaded first. Once the order changes
        under a caller still reading (a failed call moved on while loads changed), the rest is one snapshot of the
        fleet as it is then, ranked alike: O(n log n) on that path only."""
        self.sync()
        if not self.healthy:
            return
        k %= len(self.healthy)
        version, seen = self.version, set()
        for node in itertools.chain(first, self.by_load(k)):
            if id(node) in seen:
                continue
            seen.add(id(node))
            yield node
            if self.version != version:
                break
        else:
            return
        self.sync()
        if not self.healthy:
            return
        k %= len(self.healthy)
        depth = depth or {}
        rest = [n for n in self.rotation(k) if id(n) not in seen]
        yield from sorted(rest, key=lambda n: (-depth.get(n.address, 0), self.score[id(n)]))  # stable: rotation
