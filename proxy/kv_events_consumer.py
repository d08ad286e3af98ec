"""Reads the nodes' KV events (serving/kv_events.py) from the Redis stream into the proxy's KVIndex.

One asyncio task: XREAD from the last entry id seen (at start: the stream's first retained entry, so the
snapshots and deltas still in the stream rebuild the index), blocking at most `BLOCK_S` per call under a
socket deadline a little longer. A Redis that fails is logged once (and its recovery once) and retried
every `RETRY_S`; meanwhile the index stays as it was (routes may grow stale, answers do not change). An
entry that is no batch is skipped with one log line.
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from pdserve.proxy.kv_index import KVIndex
from pdserve.serving.announce import without_credentials
from pdserve.serving.kv_events import FIELD, STREAM

logger = logging.getLogger(__name__)

BLOCK_S = 1.0  # one XREAD waits this long for new entries at most
RETRY_S = 1.0  # after a failed read
BATCH = 512  # entries per read


class KVEventsConsumer:
    def __init__(self, url: str, index: KVIndex, stream: str = STREAM) -> None:
        import redis.asyncio

        self.url, self.index, self.stream = url, index, stream
        self.client: Any = redis.asyncio.Redis.from_url(url, socket_timeout=BLOCK_S + 2.0,
                                                        socket_connect_timeout=BLOCK_S + 2.0)
        self.last_id = "0"
        self.entries = 0
        self.malformed = 0
        self._failing: str | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())
        logger.info("KV events from %s stream %s: kv-aware routes from the index", without_credentials(self.url),
                    self.stream)

    async def _run(self) -> None:
        while True:
            if not await self.read_once():
                await asyncio.sleep(RETRY_S)

    async def read_once(self) -> bool:
        """One XREAD and its entries applied; False when Redis failed."""
        import redis

        try:
            reply = await self.client.xread({self.stream: self.last_id}, count=BATCH, block=int(BLOCK_S * 1000))
        except (redis.RedisError, OSError) as e:
            if self._failing is None:
                logger.warning("KV events from %s failed (%s): routing from the index as it stands",
                               without_credentials(self.url), e)
            self._failing = str(e)
            return False
        if self._failing is not None:
            logger.info("KV events from %s flow again", without_credentials(self.url))
            self._failing = None
        for _, entries in reply or []:
            for entry_id, fields in entries:
                self.last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                self._apply(fields)
        return True

    def _apply(self, fields: dict[Any, Any]) -> None:
        self.entries += 1
        raw = fields.get(FIELD.encode(), fields.get(FIELD))
        try:
            batch = json.loads(raw)
            if not isinstance(batch, dict):
                raise ValueError("not an object")
            self.index.apply(batch)
        except (TypeError, ValueError) as e:
            self.malformed += 1
            logger.warning("KV event entry %s skipped: %s", self.last_id, e)

    def status(self) -> dict[str, Any]:
        return {"stream": self.stream, "where": without_credentials(self.url), "entries": self.entries,
                "malformed": self.malformed, "last_id": self.last_id, "error": self._failing,
                **self.index.status()}

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.client.aclose()
