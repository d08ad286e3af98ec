"""Several "hosts" on one machine: Linux network namespaces on one bridge (needs root and iproute2).

Each host is a namespace with its own loopback and one interface, eth0, holding its own address;
the bridge in the root namespace joins them, and holds the .1 address, so the test process itself
is one more host (the client). Setting a host's eth0 down is a partition: its packets vanish
without a reset, as when a cable is pulled, which loopback can never show.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field

import pytest


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


@dataclass
class NetnsLab:
    """Namespaces `<tag>-<host>` on bridge `<tag>br`, addresses 10.231.<net>.<n> (the bridge: .1)."""

    hosts: list[str]
    tag: str = field(default_factory=lambda: f"pd{os.getpid() % 100000}")
    net: int = field(default_factory=lambda: 16 + os.getpid() % 224)  # concurrent runs use other subnets
    created: list[str] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"{self.tag}br"

    @property
    def client_address(self) -> str:
        return f"10.231.{self.net}.1"

    def address(self, host: str) -> str:
        return f"10.231.{self.net}.{10 + self.hosts.index(host)}"

    def namespace(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def exec_argv(self, host: str, argv: list[str]) -> list[str]:
        """argv run inside `host` (ip netns exec replaces itself with the command: signals reach it)."""
        return ["ip", "netns", "exec", self.namespace(host), *argv]

    def create(self) -> None:
        """The bridge and every namespace; fails the test with one line when namespaces are unavailable."""
        if os.geteuid() != 0:
            pytest.fail("network namespaces unavailable: the multi-host test must run as root", pytrace=False)
        self.destroy()  # leftovers of a killed run with the same tag
        probe = _ip("netns", "add", self.namespace(self.hosts[0]), check=False)
        if probe.returncode != 0:
            pytest.fail(f"network namespaces unavailable: ip netns add: {probe.stderr.strip()}", pytrace=False)
        self.created.append(self.namespace(self.hosts[0]))
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.client_address}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, host in enumerate(self.hosts):
            ns = self.namespace(host)
            if ns not in self.created:
                _ip("netns", "add", ns)
                self.created.append(ns)
            veth = f"{self.tag}v{i}"
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def set_link(self, host: str, up: bool) -> None:
        _ip("-n", self.namespace(host), "link", "set", "eth0", "up" if up else "down")

    def destroy(self) -> None:
        """Kill whatever still runs in our namespaces, then delete them and the bridge (idempotent)."""
        names = set(self.created) | {self.namespace(h) for h in self.hosts}
        for ns in names:
            pids = _ip("netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        deadline = time.monotonic() + 10
        for ns in names:
            while _ip("netns", "pids", ns, check=False).stdout.strip() and time.monotonic() < deadline:
                time.sleep(0.1)
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", self.bridge, check=False)  # its veth ends went with their namespaces
        self.created.clear()
