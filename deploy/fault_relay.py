"""A TCP relay that makes a healthy server look slow or frozen: the chaos tests' and benchmarks' fault.

Point a client at the relay instead of the server (e.g. a node's `--kv-store redis://127.0.0.1:<relay>`)
and set `delay_s`: every byte the server sends back reaches the client `delay_s` later (requests go
through at once, so N concurrent commands cost one delay, not N, like a long network path).
`delay_s` can change while connections are open; a large value is a frozen server whose
sockets stay open (the failure a timeout, not a connection error, must catch).

    relay = FaultRelay("127.0.0.1", redis_port); port = relay.start(); relay.delay_s = 2.0

Also a command for manual experiments: `python -m pdserve.deploy.fault_relay --target 127.0.0.1:6379 --delay 2`.
"""
from __future__ import annotations

import argparse
import asyncio
import threading
import time

from pdserve.deploy.processes import HOST

_BUFFER = 1 << 16


class FaultRelay:
    """Listens on HOST:port and forwards to target; the reply direction is held back `delay_s`."""

    def __init__(self, target_host: str, target_port: int, delay_s: float = 0.0, port: int = 0) -> None:
        self.target = (target_host, target_port)
        self.delay_s = delay_s
        self.port = port
        self.num_connections = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._thread: threading.Thread | None = None
        self._tasks: set[asyncio.Task] = set()

    def start(self) -> int:
        """Start serving in a daemon thread; returns the port."""
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="fault-relay", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fault relay did not start")
        return self.port

    def stop(self) -> None:
        """Close the listener and every relayed connection."""
        loop = self._loop
        if loop is None:
            return
        asyncio.run_coroutine_threadsafe(self._close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(10)
        self._loop = None

    def _run(self, ready: threading.Event) -> None:
        loop = self._loop = asyncio.new_event_loop()
        self._server = loop.run_until_complete(asyncio.start_server(self._relay, HOST, self.port))
        self.port = self._server.sockets[0].getsockname()[1]
        ready.set()
        loop.run_forever()
        loop.close()

    async def _close(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _relay(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        try:
            server_r, server_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.close()
            return
        pending: asyncio.Queue = asyncio.Queue()  # (arrival time, bytes) of the reply direction
        tasks = [asyncio.ensure_future(t) for t in (self._pump(client_r, server_w, None),
                                                    self._pump(server_r, None, pending),
                                                    self._deliver(pending, client_w))]
        self._tasks.update(tasks)
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            self._tasks.difference_update(tasks)
            client_w.close()
            server_w.close()

    @staticmethod
    async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter | None,
                    pending: asyncio.Queue | None) -> None:
        while data := await reader.read(_BUFFER):
            if pending is not None:
                pending.put_nowait((time.monotonic(), data))
            else:
                assert writer is not None
                writer.write(data)
                await writer.drain()
        if pending is not None:
            pending.put_nowait((time.monotonic(), b""))

    async def _deliver(self, pending: asyncio.Queue, writer: asyncio.StreamWriter) -> None:
        """Write each reply chunk once it is `delay_s` old (re-read while waiting: a thaw takes effect)."""
        while True:
            arrived, data = await pending.get()
            while (wait := arrived + self.delay_s - time.monotonic()) > 0:
                await asyncio.sleep(min(wait, 0.05))
            if not data:
                return
            writer.write(data)
            await writer.drain()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.deploy.fault_relay", description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="host:port of the real server")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (default: a free one)")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds added to every reply (default 0)")
    args = parser.parse_args(argv)
    host, _, port = args.target.rpartition(":")
    relay = FaultRelay(host or HOST, int(port), args.delay, args.port)
    print(f"relaying {HOST}:{relay.start()} -> {args.target} with {args.delay:g} s reply delay (Ctrl-C stops)",
          flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        relay.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
