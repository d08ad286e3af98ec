"""Stop `make serve` when make itself is told to stop, not only when the launcher is.

A terminal's Ctrl-C reaches the whole foreground process group; a `kill -INT <make's pid>` reaches
make alone, and GNU make does not pass SIGINT on to its recipe (only SIGTERM): it restores the default
action and waits for the recipe to end, so without this the cluster ran on and make never exited. What
the launcher can see from outside is that change: make catches SIGINT, SIGTERM and SIGHUP while it runs
a recipe and stops catching the one it received (Linux's /proc/<pid>/status, `SigCgt`). A parent that
goes away altogether (make killed) is the same news.

`ParentWatch.start()` polls in a daemon thread and, on either, sends this process `signal` (SIGTERM by
default), whose handler stops the cluster the same way as a signal sent to the launcher itself.
"""
from __future__ import annotations

import os
import signal as _signal
import threading
from pathlib import Path

# GNU make's fatal signals; the one make received is the bit that vanishes from its SigCgt.
_WATCHED = (_signal.SIGINT, _signal.SIGTERM, _signal.SIGHUP)
_MAKES = ("make", "gmake")


def _comm(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def caught_signals(pid: int) -> set[int] | None:
    """The signals `pid` has handlers for (None when /proc does not say: gone, or not Linux)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                mask = int(line.split()[1], 16)
                return {s for s in range(1, 65) if mask >> (s - 1) & 1}
    except (OSError, ValueError):
        return None
    return None


def find_make(pid: int | None = None) -> int | None:
    """The make process running us: our parent, or its parent when make ran a shell for the recipe."""
    pid = os.getppid() if pid is None else pid
    for _ in range(2):
        if pid <= 1:
            return None
        if _comm(pid) in _MAKES:
            return pid
        try:  # the parent of a shell: field 4 of /proc/<pid>/stat, after the parenthesised name
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return None
    return None


class ParentWatch:
    """Signals this process when its parent exits or, for make, when make received a fatal signal."""

    def __init__(self, interval_s: float = 0.2, signal: int = _signal.SIGTERM) -> None:
        self.interval_s = interval_s
        self.signal = signal
        self.parent = os.getppid()
        self.make = find_make(self.parent)
        caught = caught_signals(self.make) if self.make else None
        self._watched = {s for s in _WATCHED if caught and s in caught}
        self._stop = threading.Event()
        self.reason: str | None = None

    def check(self) -> str | None:
        """Why we should stop, or None."""
        if os.getppid() != self.parent:
            return f"parent process {self.parent} exited"
        if self.make and self._watched:
            caught = caught_signals(self.make)
            if caught is None:
                return f"make (pid {self.make}) exited"
            lost = self._watched - caught
            if lost:
                return f"make (pid {self.make}) received {_signal.Signals(min(lost)).name}"
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.reason = self.check()
            if self.reason:
                os.kill(os.getpid(), self.signal)
                return

    def start(self) -> ParentWatch:
        threading.Thread(target=self._run, name="parent-watch", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()
