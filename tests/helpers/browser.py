"""A real headless Chromium driven over the DevTools protocol (for the proxy's status page test).

Debian's `chromium` package (`make test` installs it). Each Browser gets a fresh profile
directory, no network services of its own, and a free DevTools port that Chromium reports in
`DevToolsActivePort`. Page errors are collected from the protocol's events: uncaught
exceptions, console.error/assert calls and the browser's own error log entries (failed
loads, CSP violations).
"""
from __future__ import annotations

import asyncio
import base64
import itertools
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--no-default-browser-check",
         "--disable-dev-shm-usage", "--hide-scrollbars", "--mute-audio"]


def chromium_path() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    assert exe, "chromium is not installed (make test installs it: apt-get install chromium)"
    return exe


class Browser:
    """One Chromium process and a websocket to its first page."""

    def __init__(self, width: int = 1200, height: int = 800) -> None:
        self.profile = Path(tempfile.mkdtemp(prefix="pdserve-chromium-"))
        self.proc = subprocess.Popen(
            [chromium_path(), *FLAGS, f"--user-data-dir={self.profile}", "--remote-debugging-port=0",
             f"--window-size={width},{height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.errors: list[str] = []
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._events: dict[str, asyncio.Event] = {}
        self._http: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._reader: asyncio.Task | None = None

    async def _devtools_port(self, timeout_s: float) -> int:
        marker = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.proc.returncode}")
            text = marker.read_text() if marker.exists() else ""
            if "\n" in text:
                return int(text.split("\n")[0])
            await asyncio.sleep(0.05)
        raise TimeoutError("chromium did not open its DevTools port")

    async def start(self, timeout_s: float = 60.0) -> Browser:
        port = await self._devtools_port(timeout_s)
        self._http = aiohttp.ClientSession()
        async with self._http.get(f"http://127.0.0.1:{port}/json/list") as r:
            page = next(t for t in await r.json() if t["type"] == "page")
        self._ws = await self._http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
        self._reader = asyncio.create_task(self._read())
        for domain in ("Page", "Runtime", "Log"):
            await self.send(f"{domain}.enable")
        return self

    async def _read(self) -> None:
        async for msg in self._ws:
            data = json.loads(msg.data)
            if "id" in data:
                fut = self._pending.pop(data["id"])
                if "error" in data:
                    fut.set_exception(RuntimeError(f"DevTools: {data['error']}"))
                else:
                    fut.set_result(data.get("result", {}))
                continue
            method, params = data.get("method"), data.get("params", {})
            self._events.setdefault(method, asyncio.Event()).set()
            if method == "Runtime.exceptionThrown":
                d = params["exceptionDetails"]
                self.errors.append(f"exception: {d.get('exception', {}).get('description') or d.get('text')}")
            elif method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
                self.errors.append("console: " + " ".join(str(a.get("value", a.get("description")))
                                                          for a in params["args"]))
            elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
                self.errors.append(f"log: {params['entry']['text']} ({params['entry'].get('url', '')})")

    async def send(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        msg_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[msg_id] = fut
        await self._ws.send_str(json.dumps({"id": msg_id, "method": method, "params": params or {}}))
        return await asyncio.wait_for(fut, 30)

    async def goto(self, url: str) -> None:
        loaded = self._events.setdefault("Page.loadEventFired", asyncio.Event())
        loaded.clear()
        await self.send("Page.navigate", {"url": url})
        await asyncio.wait_for(loaded.wait(), 30)

    async def eval(self, expression: str) -> Any:
        result = await self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"evaluating {expression!r}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout_s: float = 20.0) -> Any:
        """Until the JavaScript expression is truthy; returns its value."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = await self.eval(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {expression}")
            await asyncio.sleep(0.1)

    async def screenshot(self) -> bytes:
        return base64.b64decode((await self.send("Page.captureScreenshot", {"format": "png"}))["data"])

    async def close(self) -> None:
        if self._ws is not None:
            await self._ws.close()
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        if self._http is not None:
            await self._http.close()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.profile, ignore_errors=True)
