"""Real redis-servers for tests and benchmarks, on free ports, without persistence.

One server (RedisServer: stop() and start() for fault tests), or a Redis Cluster of masters (+ replicas):

    cluster = RedisClusterServer(masters=3, replicas=1)   # replicas per master (failover tests)
    cluster.start()           # ~2 s: redis refuses writes for 2 s after a master starts anyway
    open_store(cluster.url)   # redis+cluster://127.0.0.1:p1,127.0.0.1:p2,127.0.0.1:p3/
    cluster.kill(cluster.master_of(b"{chunk}"))  # SIGKILL a master; its replica takes over
    cluster.stop()

Bootstrap without `redis-cli --cluster create`: that tool polls in 1-second steps (about 2 s
more); here the slots are assigned and the nodes introduced with CLUSTER ADDSLOTSRANGE /
MEET / REPLICATE, and start() returns as soon as every node reports the same full slot map.
Each node's cluster bus port is a free port of its own (--cluster-port), not port + 10000.
`hosts` (one address per node) and `launcher` (wraps each node's command line, e.g. in
`ip netns exec NS`) let multi-host tests spread the nodes over network namespaces.
"""
from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import redis

from pdserve.deploy.processes import HOST, free_port, require_port, wait_or_kill

SLOTS = 16384


def _redis_server() -> str:
    exe = shutil.which("redis-server")
    assert exe, "redis-server is not installed (make test installs it)"
    return exe


class RedisServer:
    """A real redis-server on a free port, without persistence; stop() and start() for fault tests."""

    def __init__(self, *options: str) -> None:
        """`options`: more redis-server flags (e.g. "--maxmemory", "2gb")."""
        self.exe = _redis_server()
        self.port = free_port()
        self.options = options
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", HOST, "--save", "", "--appendonly", "no", *self.options],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        require_port(self.port)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None


@dataclass
class ClusterNodeProcess:
    host: str
    port: int
    bus_port: int
    proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def client(self, timeout: float = 5.0) -> redis.Redis:
        return redis.Redis(host=self.host, port=self.port, socket_timeout=timeout, socket_connect_timeout=timeout)


class RedisClusterServer:
    def __init__(self, masters: int = 3, replicas: int = 0, node_timeout_ms: int = 1000,
                 hosts: Sequence[str] | None = None, launcher: Callable[[int, list[str]], list[str]] | None = None,
                 extra_args: Sequence[str] = ()) -> None:
        self.exe = _redis_server()
        self.masters = masters
        count = masters * (1 + replicas)
        hosts = list(hosts or [HOST] * count)
        assert len(hosts) == count, f"{count} nodes need {count} hosts, got {len(hosts)}"
        self.nodes = [ClusterNodeProcess(h, free_port(), free_port()) for h in hosts]
        self.node_timeout_ms = node_timeout_ms
        self.launcher = launcher
        self.extra_args = list(extra_args)
        self.dir = Path(tempfile.mkdtemp(prefix="pdserve-redis-cluster-"))

    @property
    def url(self) -> str:
        """Every master as a startup node (the client finds the replicas itself)."""
        return "redis+cluster://" + ",".join(n.address for n in self.nodes[:self.masters]) + "/"

    def start(self, timeout: float = 30.0) -> None:
        try:
            for i, node in enumerate(self.nodes):
                argv = [self.exe, "--port", str(node.port), "--bind", node.host, "--cluster-enabled", "yes",
                        "--cluster-port", str(node.bus_port), "--cluster-config-file", f"nodes-{node.port}.conf",
                        "--cluster-node-timeout", str(self.node_timeout_ms), "--cluster-replica-validity-factor", "0",
                        "--save", "", "--appendonly", "no", "--repl-diskless-sync-delay", "0",
                        "--dir", str(self.dir), *self.extra_args]
                node.proc = subprocess.Popen(self.launcher(i, argv) if self.launcher else argv,
                                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for node in self.nodes:
                require_port(node.port, timeout, node.host)
            self._bootstrap(timeout)
        except BaseException:
            self.stop()
            raise

    def _bootstrap(self, timeout: float) -> None:
        clients = [n.client() for n in self.nodes]
        ids = [c.execute_command("CLUSTER MYID").decode() for c in clients]
        for i in range(self.masters):
            lo, hi = i * SLOTS // self.masters, (i + 1) * SLOTS // self.masters - 1
            clients[i].execute_command("CLUSTER ADDSLOTSRANGE", lo, hi)
            clients[i].execute_command("CLUSTER SET-CONFIG-EPOCH", i + 1)
        first = self.nodes[0]
        for c in clients[1:]:
            c.execute_command("CLUSTER MEET", first.host, first.port, first.bus_port)
        self._wait(lambda: all(int(c.cluster("info")["cluster_known_nodes"]) == len(clients) for c in clients),
                   timeout, "the nodes to meet")
        for i, c in enumerate(clients[self.masters:]):
            c.execute_command("CLUSTER REPLICATE", ids[i % self.masters])
        self._wait(lambda: all(self._settled(c) for c in clients), timeout, "the cluster to settle")
        for c in clients:
            c.close()

    def _settled(self, client: redis.Redis) -> bool:
        """This node sees the whole slot map and every replica attached (and, if one, in sync)."""
        info = client.cluster("info")
        if info["cluster_state"] != "ok" or int(info["cluster_slots_ok"]) != SLOTS:
            return False
        nodes = client.cluster("nodes")
        replicas = sum("slave" in n["flags"] for n in nodes.values())
        if replicas != len(self.nodes) - self.masters or any("handshake" in n["flags"] for n in nodes.values()):
            return False
        role = client.info("replication")
        return role["role"] == "master" or role.get("master_link_status") == "up"

    @staticmethod
    def _wait(ready: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis cluster: waited {timeout:.0f}s for {what}")
            time.sleep(0.02)

    def master_of(self, key: bytes | str) -> ClusterNodeProcess:
        """The node that serves `key`'s slot now."""
        for node in self.nodes:
            if node.proc is None or node.proc.poll() is not None:
                continue
            with node.client() as c:
                if c.info("replication")["role"] != "master":
                    continue
                slot = c.cluster("keyslot", key)
                if any(lo <= slot <= hi for lo, hi in _own_slots(c)):
                    return node
        raise LookupError(f"no live master serves {key!r}")

    def replicate(self) -> None:
        """Block until every master's replicas hold all its writes (WAIT)."""
        if len(self.nodes) == self.masters:
            return
        for node in self.nodes:
            if node.proc is not None and node.proc.poll() is None:
                with node.client() as c:
                    if c.info("replication")["role"] == "master":
                        c.execute_command("WAIT", len(self.nodes) // self.masters - 1, 5000)

    def flushall(self) -> None:
        for node in self.nodes:
            if node.proc is not None and node.proc.poll() is None:
                with node.client() as c:
                    if c.info("replication")["role"] == "master":
                        c.flushall()

    def kill(self, node: ClusterNodeProcess) -> None:
        """SIGKILL: a crashed master, for failover tests."""
        if node.proc is not None:
            node.proc.send_signal(signal.SIGKILL)
            node.proc.wait()

    def stop(self) -> None:
        for node in self.nodes:
            if node.proc is not None and node.proc.poll() is None:
                node.proc.terminate()
        for node in self.nodes:
            if node.proc is not None:
                wait_or_kill(node.proc, 10)
                node.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)


def _own_slots(client: redis.Redis) -> list[tuple[int, int]]:
    """Slot ranges this node serves, as its own CLUSTER NODES line says."""
    for node in client.cluster("nodes").values():
        if "myself" in node["flags"]:
            return [(int(r[0]), int(r[-1])) for r in node["slots"] if str(r[0]).isdigit()]
    return []
