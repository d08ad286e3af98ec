"""Several "hosts" on one machine, as Linux network namespaces (needs root and iproute2).

NetnsLab: namespaces on one bridge. Each host is a namespace with its own loopback and one interface,
eth0, holding its own address; the bridge in the root namespace joins them, and holds the .1 address, so
the calling process itself is one more host (the client). Setting a host's eth0 down is a partition: its
packets vanish without a reset, as when a cable is pulled, which loopback can never show. Used by
tests/cluster/test_multihost_netns.py.

Link: two namespaces joined by one veth pair, shaped with `tc`. The store host's end of the pair is shaped on egress (the KV flows store -> decode; requests are
small), with `netem` (rate and one-way delay) where the kernel has it, else `tbf` (rate only; then a
delay cannot be emulated and the setting says so instead of pretending). The link's own ceiling is
a plain TCP transfer of a given number of bytes over it (`LinkSender` / `plain_transfer`): what any
reader of those bytes could reach, so a load's bytes/s is judged against it.

Used by benchmarks/kv_link.py and tests/cluster/test_kv_link.py.
"""
from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field

_LEN = struct.Struct("<Q")
_PIECE = 4 << 20  # sender's write size: large enough that syscalls never bound a 25 Gbit/s link


class NetnsError(RuntimeError):
    """Namespaces or a link could not be made or shaped (no root, no netns, an unknown qdisc)."""


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise NetnsError(f"{' '.join(argv)}: {proc.stderr.strip()}")
    return proc


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run(["ip", *args], check)


def exec_argv(ns: str, argv: list[str]) -> list[str]:
    """argv run inside namespace `ns` (ip netns exec replaces itself with the command: signals reach it)."""
    return ["ip", "netns", "exec", ns, *argv]


def _delete_namespaces(names: set[str] | tuple[str, ...]) -> None:
    """Kill whatever still runs in the namespaces, then delete them (their veth ends go with them)."""
    for ns in names:
        for pid in _ip("netns", "pids", ns, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    deadline = time.monotonic() + 10
    for ns in names:
        while _ip("netns", "pids", ns, check=False).stdout.strip() and time.monotonic() < deadline:
            time.sleep(0.1)
        _ip("netns", "del", ns, check=False)


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
        """argv run inside `host`."""
        return exec_argv(self.namespace(host), argv)

    def create(self) -> None:
        """The bridge and every namespace; NetnsError (one line) when namespaces are unavailable."""
        if os.geteuid() != 0:
            raise NetnsError("network namespaces unavailable: the multi-host test must run as root")
        self.destroy()  # leftovers of a killed run with the same tag
        probe = _ip("netns", "add", self.namespace(self.hosts[0]), check=False)
        if probe.returncode != 0:
            raise NetnsError(f"network namespaces unavailable: ip netns add: {probe.stderr.strip()}")
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
        _delete_namespaces(set(self.created) | {self.namespace(h) for h in self.hosts})
        _ip("link", "del", self.bridge, check=False)
        self.created.clear()


@dataclass(frozen=True)
class Shape:
    """A link setting: rate in Gbit/s (None: unshaped veth) and one-way delay in ms."""

    rate_gbit: float | None = None
    delay_ms: float = 0.0

    def __str__(self) -> str:
        if self.rate_gbit is None:
            return "unshaped veth"
        return f"{self.rate_gbit:g} Gbit/s, {self.delay_ms:g} ms"


@dataclass
class Link:
    """Namespaces `<tag>-store` and `<tag>-decode`, one veth pair between them named eth0 on both sides,
    addresses 10.232.<net>.1 (store) and .2 (decode)."""

    tag: str = field(default_factory=lambda: f"kvl{os.getpid() % 100000}")
    net: int = field(default_factory=lambda: 16 + os.getpid() % 224)

    @property
    def store_ns(self) -> str:
        return f"{self.tag}-store"

    @property
    def decode_ns(self) -> str:
        return f"{self.tag}-decode"

    @property
    def store_address(self) -> str:
        return f"10.232.{self.net}.1"

    @property
    def decode_address(self) -> str:
        return f"10.232.{self.net}.2"

    def exec_argv(self, ns: str, argv: list[str]) -> list[str]:
        """argv run inside namespace `ns`."""
        return exec_argv(ns, argv)

    def create(self) -> None:
        if os.geteuid() != 0:
            raise NetnsError("a shaped link needs root (network namespaces and tc)")
        self.destroy()  # leftovers of a killed run with the same tag
        a, b = f"{self.tag}a", f"{self.tag}b"
        for ns in (self.store_ns, self.decode_ns):
            _ip("netns", "add", ns)
        _ip("link", "add", a, "type", "veth", "peer", "name", b)
        for dev, ns, address in ((a, self.store_ns, self.store_address), (b, self.decode_ns, self.decode_address)):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "link", "set", dev, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def shape(self, setting: Shape) -> str:
        """Apply `setting` to the store side's egress; returns the qdisc used. Raises NetnsError when the
        kernel cannot emulate the delay (no sch_netem) rather than measuring a different link."""
        base = ["tc", "-n", self.store_ns, "qdisc"]
        _run([*base, "del", "dev", "eth0", "root"], check=False)
        if setting.rate_gbit is None:
            if setting.delay_ms:
                raise NetnsError("a delay needs a rate here")
            return "none"
        rate = f"{setting.rate_gbit:g}gbit"
        netem = _run([*base, "replace", "dev", "eth0", "root", "netem", "rate", rate,
                      "delay", f"{setting.delay_ms:g}ms", "limit", "100000"], check=False)
        if netem.returncode == 0:
            return "netem"
        if setting.delay_ms:
            raise NetnsError(f"this kernel has no sch_netem ({netem.stderr.strip()}): a {setting.delay_ms:g} ms "
                            f"delay cannot be emulated")
        # tbf's bucket must hold a timer tick's worth of bytes at the rate, or the rate is never reached
        burst = max(int(setting.rate_gbit * 1e9 / 8 / 1000), 256 << 10)
        _run([*base, "replace", "dev", "eth0", "root", "tbf", "rate", rate, "burst", str(burst), "latency", "50ms"])
        return "tbf"

    def destroy(self) -> None:
        """Kill whatever still runs in the namespaces, then delete them (the veth pair goes with them)."""
        _delete_namespaces((self.store_ns, self.decode_ns))

    def __enter__(self) -> Link:
        self.create()
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()


def serve_bytes(host: str, port: int) -> None:
    """The plain sender: for each connection, any number of requests of an 8-byte length, each answered
    with that many bytes from memory. Runs until killed."""
    payload = memoryview(bytearray(_PIECE))
    with socket.create_server((host, port), reuse_port=False) as server:
        while True:
            conn, _ = server.accept()
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                while (head := _recv_exact(conn, _LEN.size)) is not None:
                    left = _LEN.unpack(head)[0]
                    while left:
                        sent = conn.send(payload[:min(left, _PIECE)])
                        left -= sent


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        part = conn.recv(n - len(buf))
        if not part:
            return None
        buf += part
    return bytes(buf)


def start_sender(link: Link, port: int) -> subprocess.Popen:
    """`serve_bytes` inside the store namespace, listening on the store address."""
    argv = link.exec_argv(link.store_ns, [sys.executable, "-m", "pdserve.deploy.netns", "serve-bytes",
                                          link.store_address, str(port)])
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def plain_transfer(host: str, port: int, nbytes: int, repeats: int = 3, timeout_s: float = 120.0) -> float:
    """Best seconds to receive `nbytes` from the sender (one round trip included, as a load has), into one
    pre-faulted buffer. The link's ceiling for a reader of those bytes."""
    buf = bytearray(nbytes)
    view = memoryview(buf)
    best = float("inf")
    with socket.create_connection((host, port), timeout=timeout_s) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)
        for _ in range(repeats):
            start = time.perf_counter()
            conn.sendall(_LEN.pack(nbytes))
            got = 0
            while got < nbytes:
                n = conn.recv_into(view[got:], nbytes - got)
                if not n:
                    raise ConnectionError("the sender closed the link mid-transfer")
                got += n
            best = min(best, time.perf_counter() - start)
    return best


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "serve-bytes":
        serve_bytes(sys.argv[2], int(sys.argv[3]))
    else:
        sys.exit("usage: python -m pdserve.deploy.netns serve-bytes HOST PORT")
