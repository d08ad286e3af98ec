"""Which of several proxies over one fleet registry runs the planner: the holder of a lease in that Redis.

Proxies side by side (replicas of one Deployment) see one fleet; if each ran its planner, each would move a node
for the same pressure. The lease is one key, `pdserve:planner:leader`, holding its proxy's id with a TTL of a few
planner intervals: the holder renews it at each decision, the others hold (GET /planner says who leads) and take
it over within one TTL when the holder stops renewing (it died, or lost the registry). A stopping proxy hands it
back at once. Without a registry every proxy plans for itself (docs/operations.md, "A fleet").

A registry that cannot be reached makes this proxy a follower until it can: two planners acting at once cost a
fleet extra moves; none acting for a while costs only the moves' delay. Answers never depend on it.
"""
from __future__ import annotations

import logging
import os
import socket
import uuid
from typing import Any

logger = logging.getLogger(__name__)

LEASE_KEY = "pdserve:planner:leader"
_MIN_TTL_S = 5.0

# Take the lease when free, renew it when ours; 1 when held after the call.
_TAKE = """
local v = redis.call('GET', KEYS[1])
if not v then redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) return 1 end
if v == ARGV[1] then redis.call('PEXPIRE', KEYS[1], ARGV[2]) return 1 end
return 0
"""
_GIVE_BACK = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


def proxy_id() -> str:
    """This process among the proxies: host, pid and a random part (pids repeat across containers)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class PlannerLease:
    def __init__(self, url: str, interval_s: float, timeout_s: float = 1.0, ident: str | None = None) -> None:
        import redis.asyncio

        self.id = ident or proxy_id()
        self.ttl_ms = int(max(_MIN_TTL_S, 3 * interval_s) * 1000)
        self.client: Any = redis.asyncio.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.leader: bool = False
        self.holder: str | None = None  # the id the registry last named (None: unknown or free)
        self._error: str | None = None

    async def held(self) -> bool:
        """Take or renew the lease; whether this proxy holds it now (False while the registry cannot answer)."""
        import redis

        try:
            took = await self.client.eval(_TAKE, 1, LEASE_KEY, self.id, self.ttl_ms)
            holder = self.id if took else await self.client.get(LEASE_KEY)
        except (redis.RedisError, OSError) as e:
            if self._error is None:
                logger.warning("planner lease: registry unreachable (%s): this proxy holds its planner until it "
                               "answers", type(e).__name__)
            self._error, self.leader = str(e), False
            return False
        if self._error is not None:
            logger.info("planner lease: registry answers again")
            self._error = None
        self.holder = holder.decode() if isinstance(holder, bytes) else holder
        if bool(took) != self.leader:
            logger.info("planner lease: this proxy (%s) %s", self.id, "now runs the fleet's planner" if took else
                        f"follows the planner of {self.holder}")
        self.leader = bool(took)
        return self.leader

    async def release(self) -> None:
        """Hand the lease back (another proxy takes it at its next decision), then close the connection."""
        import redis

        try:
            if self.leader:
                await self.client.eval(_GIVE_BACK, 1, LEASE_KEY, self.id)
        except (redis.RedisError, OSError):
            pass  # it expires within its TTL
        finally:
            self.leader = False
            await self.client.aclose()

    def status(self) -> dict[str, object]:
        return {"id": self.id, "leader": self.leader, "holder": self.holder, "ttl_s": self.ttl_ms / 1000,
                "error": self._error}
