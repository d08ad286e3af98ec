"""One client stream over decode nodes that may die or freeze: deadlines, retries and resumption.

Every call to a decode node has deadlines (`Deadlines`): to connect, to the first token, between
tokens, and between any two messages (the node sends a heartbeat each second while it waits, so
a stream silent for `stall_s` means a frozen node, not a busy one). A node that misses one, or
whose stream breaks, leaves the rotation at once. Before the first token the request simply
goes to the next node; after it, the next node *resumes* it: it gets the prompt plus the tokens
the client already has (pb.Resume), loads the prompt's KV from the store, recomputes those
tokens and continues, so the client sees one uninterrupted stream whose greedy or seeded output
equals an uninterrupted run.

When no other decode node can take the stream (one decode node, or every other out of rotation), a
silent or broken node is not given up at the stall deadline: the stream waits for it up to `recovery_s`
of silence in all (pd-proxy --decode-recovery-timeout), reading on if it answers again (a paused
process thawed) and resuming on it once it is back in rotation if its stream broke meanwhile; another
node that enters rotation meanwhile takes the stream at once. Only past that bound does the stream fail.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator

import grpc

from pdserve.protos import pdserve_pb2 as pb
from pdserve.proxy.health import Node
from pdserve.proxy.router import Router
from pdserve.serving import errors
from pdserve.serving import protocol as oai
from pdserve.serving.heartbeat import HEARTBEAT_S

logger = logging.getLogger(__name__)

# Codes that say "this node could not serve it" (another node may), as opposed to "bad request".
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
             grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
             grpc.StatusCode.ABORTED)


# Request fields whose answer rides on a stream's first delta (when the wire carries them).
_SENT_WITH_THE_FIRST_DELTA = ("echo", "prompt_logprobs")


def _field(message: Any, name: str, default: int) -> int:
    """A field the wire format may not have (yet): its value, else `default`."""
    return getattr(message, name) if name in message.DESCRIPTOR.fields_by_name else default


@dataclass(frozen=True)
class Deadlines:
    """Seconds a decode call may take at each stage (pd-proxy --connect-timeout, ...)."""

    connect_s: float = 5.0  # until the node's channel is ready
    first_token_s: float = 300.0  # from the call to the first token (queueing and prefill included)
    token_s: float = 60.0  # between two tokens
    stall_s: float = 5.0  # between two messages of any kind, heartbeats included: a frozen node
    # With no other decode node to go to: how long a stream waits, silence included, for its node to answer
    # again (at least stall_s); the wait ends sooner when another node enters rotation.
    recovery_s: float = 60.0

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not value > 0:
                raise ValueError(f"{_FLAGS[name]} must be a positive number of seconds, got {value}")
        if self.stall_s <= HEARTBEAT_S:
            raise ValueError(f"{_FLAGS['stall_s']} ({self.stall_s:g}s) must exceed the nodes' heartbeat "
                             f"interval ({HEARTBEAT_S:g}s), or busy nodes would count as frozen")


# The pd-proxy flag that sets each deadline: what an error about one names.
_FLAGS = {"connect_s": "--connect-timeout", "first_token_s": "--first-token-timeout", "token_s": "--token-timeout",
          "stall_s": "--stall-timeout", "recovery_s": "--decode-recovery-timeout"}
_RECHECK_S = HEARTBEAT_S  # while waiting for a node that is the only one: how often to look for another
_POLL_S = 0.1  # while waiting for a node to re-enter rotation: how often to look


def _finished(call: grpc.aio.Call) -> None:
    """Done callback that only holds a reference to the call until its status has arrived."""


def _retrieved(read: asyncio.Future) -> None:
    """Done callback of a read given up: its outcome (the call's cancellation) is of no interest."""
    if not read.cancelled():
        read.exception()


class NodeFailed(Exception):
    """The node missed a deadline or broke the stream; `down` says whether to take it out of rotation."""

    def __init__(self, reason: str, down: bool = True, error: oai.APIError | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.down = down
        self.error = error  # what to tell the client if no other node takes over


class DecodeStream:
    """Deltas of one request, from whichever decode nodes it takes (`deltas()`, iterated once)."""

    def __init__(self, request_id: str, router: Router, call: pb.GenerateRequest, lookup: pb.LookupRequest,
                 deadlines: Deadlines) -> None:
        self.request_id = request_id
        self.router = router
        self.call = call
        self.lookup = lookup
        self.deadlines = deadlines
        self.token_ids: list[int] = []  # what the client has received
        self.num_chars = 0
        self.num_resumes = 0
        self._complete = False  # the current node's call delivered every choice's finish
        # loop time of the current node's last message, or of its call's start (none yet: a request that never
        # reached a node does not wait for one to return)
        self._last_heard = float("-inf")
        self._tried: set[str] = set()  # nodes this stream went to ...
        self._returning: set[str] = set()  # ... and those of them it took out of rotation: they may take it back

    async def deltas(self) -> AsyncIterator[pb.GenerateDelta]:
        """Every delta with tokens or text or a finish reason, across node failures; APIError when none is left."""
        tried = self._tried
        last_error = oai.service_unavailable("no healthy decode node", "no_healthy_decode_node")
        recover_until = None  # after a node failure: until when a node taken out of rotation may come back
        while True:
            node = await self._next_node(recover_until)
            if node is None:
                if self.token_ids:
                    raise oai.service_unavailable(
                        f"the stream broke after {len(self.token_ids)} tokens and no other decode node is "
                        f"healthy: {last_error.message}", "no_healthy_decode_node")
                raise last_error
            tried.add(node.address)
            self._returning.discard(node.address)
            call = self.call
            if self.token_ids:
                if self.num_choices > 1:  # n choices interleave: no single point to resume from
                    raise oai.service_unavailable(f"the stream broke after {len(self.token_ids)} tokens: "
                                                  f"{last_error.message}", "decode_node_failed")
                call = self._resume_call()
                self.num_resumes += 1
                logger.warning("Reqid: %s, resuming on %s after %d tokens", self.request_id, node.address,
                               len(self.token_ids))
            else:  # written once the call is on its way: off the path of its first token
                asyncio.get_running_loop().call_soon(logger.info, "Reqid: %s, decoding on %s", self.request_id,
                                                     node.address)
            try:
                async for delta in self._deltas(node, call):
                    self.token_ids.extend(delta.token_ids)
                    self.num_chars += len(delta.text)
                    yield delta
                if self._complete:
                    return
                raise NodeFailed("the stream ended without a finish reason")
            except NodeFailed as e:
                if e.down:
                    node.mark_down(e.reason)
                    self._returning.add(node.address)
                recover_until = self._last_heard + max(self.deadlines.recovery_s, self.deadlines.stall_s)
                # raised only once no other node is left: then that is what the client is told
                last_error = e.error or oai.service_unavailable(f"decode node {node.address}: {e.reason}",
                                                                "no_healthy_decode_node")
                logger.warning("Reqid: %s, decode on %s failed after %d tokens (%s); %s", self.request_id,
                               node.address, len(self.token_ids), e.reason,
                               "resuming on another node" if self.token_ids else "trying the next node")

    def _can_move(self) -> bool:
        """Whether another node could take this stream: n choices that have begun cannot be resumed."""
        return not self.token_ids or self.num_choices == 1

    def _eligible(self, node: Node) -> bool:
        return node.healthy and (node.address not in self._tried or node.address in self._returning)

    def _elsewhere(self, current: Node) -> bool:
        """Whether a node other than `current` is in rotation and may take this stream now."""
        return self._can_move() and any(n is not current and self._eligible(n) for n in self.router.healthy())

    async def _next_node(self, recover_until: float | None) -> Node | None:
        """The best node that may take the stream; after a node failure with none left, wait (until
        `recover_until`) for one this stream took out of rotation to come back, or for a new one."""
        loop = asyncio.get_running_loop()
        waited = False
        while True:
            node = next((n for n in await self.router.rank(self.lookup) if self._eligible(n)), None)
            if node is not None or recover_until is None or not self._can_move() or loop.time() >= recover_until:
                if waited and node is not None:
                    logger.info("Reqid: %s, decode node %s back in rotation", self.request_id, node.address)
                return node
            if not waited:
                waited = True
                logger.warning("Reqid: %s, no decode node can take the stream after %d tokens; waiting up to %.1f s "
                               "for %s to return", self.request_id, len(self.token_ids),
                               recover_until - loop.time(), ", ".join(sorted(self._returning)) or "one")
            await asyncio.sleep(min(_POLL_S, max(0.0, recover_until - loop.time())))

    @property
    def num_choices(self) -> int:
        return max(1, _field(self.call.params, "n", 1))

    def _resume_call(self) -> pb.GenerateRequest:
        """The original call plus where it stopped; what the client already has (an echoed prompt,
        prompt logprobs) is not asked for again."""
        call = pb.GenerateRequest()
        call.CopyFrom(self.call)
        call.resume.CopyFrom(pb.Resume(output_token_ids=self.token_ids, num_sent_chars=self.num_chars))
        call.ClearField("first_token")  # the client has it: it is among the resumed tokens
        for name in _SENT_WITH_THE_FIRST_DELTA:
            if name in call.params.DESCRIPTOR.fields_by_name:
                call.params.ClearField(name)
        return call

    async def _deltas(self, node: Node, call: pb.GenerateRequest) -> AsyncIterator[pb.GenerateDelta]:
        """One node's deltas (heartbeats dropped) under the deadlines; NodeFailed when it misses one.

        Ends with the delta that finishes the last open choice (`_complete`): the call's status
        follows, but the client need not wait for it (one more network hop and event-loop wake-up)."""
        d = self.deadlines
        self._complete = False
        open_choices = self.num_choices
        try:
            await node.ready(d.connect_s)
        except asyncio.TimeoutError as e:
            raise NodeFailed(str(e)) from None
        node.load.in_flight += 1
        node.routed += 1
        stream = node.generate(call)
        loop = asyncio.get_running_loop()
        started = self._last_heard = loop.time()
        last_token = None  # time of the last token (None: before the first)
        recovery_s = max(d.recovery_s, d.stall_s)
        stalled = False  # silent past the stall deadline, waited for: no other node could take the stream
        # A read outliving a timeout: cancelling a grpc.aio read cancels its call, so while no other node could
        # take the stream the read runs as a task of its own (one per message then, not on the usual path).
        pending: asyncio.Future | None = None
        try:
            while True:
                now = loop.time()
                token_deadline = started + d.first_token_s if last_token is None else last_token + d.token_s
                if stalled:  # look for another node each _RECHECK_S until the recovery bound
                    check = min(now + _RECHECK_S, self._last_heard + recovery_s)
                else:
                    check = self._last_heard + d.stall_s
                try:
                    # asyncio.timeout, not wait_for: no task created per message (the proxy's own latency)
                    async with asyncio.timeout(max(min(check, token_deadline) - now, 0.0)):
                        if pending is None and not self._elsewhere(node):
                            pending = asyncio.ensure_future(stream.read())
                        delta = await (stream.read() if pending is None else asyncio.shield(pending))
                    pending = None
                except TimeoutError:
                    now = loop.time()
                    if now >= token_deadline:
                        what = "first token" if last_token is None else "next token"
                        limit = d.first_token_s if last_token is None else d.token_s
                        raise NodeFailed(f"no {what} within {limit:g}s") from None
                    silent = now - self._last_heard
                    if silent < recovery_s and not self._elsewhere(node):
                        if not stalled:
                            stalled = True
                            logger.warning("Reqid: %s, decode node %s silent for %.1f s and no other decode node "
                                           "can take the stream; waiting up to %g s of silence for it",
                                           self.request_id, node.address, silent, recovery_s)
                        continue
                    raise NodeFailed(f"silent for {silent:.1f}s (frozen?)") from None
                except grpc.aio.AioRpcError as e:
                    raise self._rpc_failure(e) from None
                if delta is grpc.aio.EOF:
                    return
                now = self._last_heard = loop.time()
                if stalled:
                    stalled = False
                    logger.warning("Reqid: %s, decode node %s answered again; the stream goes on there",
                                   self.request_id, node.address)
                if delta.ByteSize():  # anything but a heartbeat (an empty message)
                    last_token = now
                    open_choices -= bool(delta.finish_reason)
                    self._complete = open_choices <= 0
                    yield delta
                    if self._complete:
                        return
        finally:
            if pending is not None:  # the node is left with a read outstanding
                pending.cancel()
                pending.add_done_callback(_retrieved)
            if not self._complete:
                stream.cancel()  # no-op once finished; aborts the node's request when we leave it
            else:  # only the status is still to come: keep the call alive until it does
                stream.add_done_callback(_finished)  # (a collected call cancels itself)
            node.load.in_flight -= 1

    def _rpc_failure(self, e: grpc.aio.AioRpcError) -> Exception:
        """A client error (4xx: no node will take it) is raised as is; anything else is the node's failure."""
        err = errors.from_rpc_error(e)
        if err is not None and err.status < 500:
            return err
        if e.code() not in RETRYABLE:
            return oai.APIError(503, f"decode failed: {e.code().name}: {e.details()}", code="decode_node_failed")
        # A full queue is the node's answer, not its death: try another, keep it in rotation.
        return NodeFailed(f"{e.code().name}: {e.details()}", down=e.code() == grpc.StatusCode.UNAVAILABLE
                          or e.code() == grpc.StatusCode.UNKNOWN, error=err)
