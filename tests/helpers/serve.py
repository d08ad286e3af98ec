"""Raw HTTP and SSE helpers for tests against a `pd-serve` (pdserve.deploy.server_process.ServerProcess)."""
from __future__ import annotations

import http.client
import json
from typing import Any
from urllib.parse import urlparse

from pdserve.deploy.server_process import ServerProcess


def sse_events(raw_lines) -> list[Any]:
    """Decoded `data:` payloads of an SSE byte-line iterator; '[DONE]' stays a string."""
    events = []
    for line in raw_lines:
        line = line.strip()
        if line.startswith(b"data: "):
            payload = line[len(b"data: "):].decode()
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def send_request(server: ServerProcess, body: dict, request_id: str,
                 path: str = "/v1/completions") -> http.client.HTTPConnection:
    """POST without reading the response yet (the caller calls getresponse() when it wants)."""
    url = urlparse(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json", "X-Request-Id": request_id})
    return conn


def open_stream(server: ServerProcess, body: dict, request_id: str) -> http.client.HTTPResponse:
    """A streaming request whose SSE lines the caller reads (or abandons) one by one."""
    resp = send_request(server, body, request_id).getresponse()
    assert resp.status == 200, resp.read()
    return resp
