"""pytest hooks: tests that need root or the network say so with a marker and skip clearly without them.

    @pytest.mark.root("mounts a tmpfs")                      -> "needs root: mounts a tmpfs"
    @pytest.mark.network("deb.debian.org:80", "debootstraps the base image")
                                                              -> "needs the network (deb.debian.org:80 ...): ..."

`netns` (registered in pyproject.toml) implies root: a namespace, a veth pair or a `tc` qdisc can only
be made by root. `make test` runs as root on CI with the network up, so there every marked test runs;
on a developer's machine without them the run says which tests it skipped and why (`-ra`), instead of
failing on a `mount` or an `ip netns add`.

tests/conftest.py registers this module as a plugin of its own (`pytest_plugins`).
"""
from __future__ import annotations

import functools
import os
import socket

import pytest

MARKERS = (
    "root(why): needs root (mounts, network namespaces, tc, debootstrap); skipped with `why` when not root",
    "network(host_port, why): needs real network access to host_port beyond loopback; skipped with `why` "
    "when it cannot be reached",
)
NETNS_WHY = "runs processes in Linux network namespaces"
PROBE_S = 5.0  # one TCP connect per host and session; an unreachable host answers nothing at all


@functools.cache
def reachable(host_port: str) -> str | None:
    """None when a TCP connection to `host:port` opens, else why not (once per host and session)."""
    host, _, port = host_port.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=PROBE_S).close()
    except (OSError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def root_reason(item: pytest.Item) -> str | None:
    """The skip reason of a test that needs root, when this process is not root; else None."""
    whys = [_why(item, mark) for mark in item.iter_markers("root")]  # (a bad mark fails as root too)
    whys += [NETNS_WHY for _ in item.iter_markers("netns")]
    if not whys or os.geteuid() == 0:
        return None
    return f"needs root: {'; '.join(dict.fromkeys(whys))}"


def network_reason(item: pytest.Item) -> str | None:
    """The skip reason of a test whose host cannot be reached; else None (probes only marked tests)."""
    for host_port, why in network_needs(item):
        failure = reachable(host_port)
        if failure is not None:
            return f"needs the network ({host_port} unreachable: {failure}): {why}"
    return None


def network_needs(item: pytest.Item) -> list[tuple[str, str]]:
    """(host:port, why) of each network mark; a mark written otherwise is a usage error."""
    needs = []
    for mark in item.iter_markers("network"):
        if len(mark.args) != 2 or not all(isinstance(a, str) and a for a in mark.args) or ":" not in mark.args[0]:
            raise pytest.UsageError(f'{item.nodeid}: write @pytest.mark.network("host:port", "why"), not {mark}')
        needs.append((mark.args[0], mark.args[1]))
    return needs


def _why(item: pytest.Item, mark: pytest.Mark) -> str:
    if len(mark.args) != 1 or not isinstance(mark.args[0], str) or not mark.args[0]:
        raise pytest.UsageError(f'{item.nodeid}: write @pytest.mark.root("why it needs root"), not {mark}')
    return mark.args[0]


def pytest_configure(config: pytest.Config) -> None:
    for line in MARKERS:
        config.addinivalue_line("markers", line)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        network_needs(item)  # a badly written mark fails the run here, not only where probed
        reason = root_reason(item)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


def pytest_runtest_setup(item: pytest.Item) -> None:
    # At set-up, not collection: a run that selects no network test probes nothing.
    reason = network_reason(item)
    if reason is not None:
        pytest.skip(reason)
