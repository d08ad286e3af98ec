"""AsyncLLMEngine: the synchronous LLMEngine driven by a dedicated step thread, for asyncio servers.

Why a thread: a step (a long prefill especially) can take seconds; run on the event loop it
would stall /health and every other connection. Torch releases the GIL inside its ops, so the
loop stays responsive. Only the step thread touches the LLMEngine (it is not thread-safe):
the loop sends it commands through a queue and gets outputs back via call_soon_threadsafe.

Why servers build the engine on that thread too (`AsyncLLMEngine.build`): every multi-threaded
CPU op of the process (torch's and kernels/csrc's, one libgomp) then runs on one thread, so the
process has one OpenMP team. A second thread running parallel ops (say, the main thread that
loaded the weights) brings a second team; libgomp then manages more threads than there are CPUs
and cuts its spin-wait to almost nothing, so every parallel region of every step waits for its
workers to be woken (docs/architecture.md, "One OpenMP team").
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from pdserve.engine.lora.request import LoRARequest
from pdserve.engine.outputs import FirstToken, Resume, StepOutput
from pdserve.engine.parallel.launcher import exit_process
from pdserve.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineOverloadedError(RuntimeError):
    """Too many accepted requests are still waiting for their first token."""


class EngineShutdownError(RuntimeError):
    """The engine is shutting down (or has stopped) and takes no new requests."""


class RequestAbortedError(RuntimeError):
    """The server aborted the request (shutdown or an engine failure), not the client."""


class RequestFailedError(RequestAbortedError):
    """This request alone failed inside the engine (an unexpected error in its own handling); the
    rest of its batch went on."""


@dataclass
class _Stream:
    request_id: str
    num_prompt_tokens: int
    arrival: float = field(default_factory=time.monotonic)  # handed to the engine: its Request.arrival_time
    last_token_time: float = 0.0
    started: bool = False  # produced its first token (or finished)
    num_open_choices: int = 1  # n: the stream ends when every choice has finished
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if not future.done():  # (its awaiter may have gone)
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)


class AsyncLLMEngine:
    """Per-request async output streams over one LLMEngine stepping in its own thread."""

    def __init__(self, engine: Any, max_waiting_requests: int = 256, metrics: Any = None) -> None:
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.metrics = metrics
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._stats = engine.get_stats()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._accepting = False
        self.num_steps = 0  # steps started (written by the step thread only)
        self._step_started: float | None = None
        self._go = threading.Event()  # build(): the waiting step thread may begin (or end: no loop)
        driver = getattr(getattr(engine, "model_runner", None), "driver", None)
        if driver is not None:  # a parallel engine: a server that lost a rank exits within seconds
            driver.ranks.watch_death(exit_process)

    @classmethod
    def build(cls, factory: Callable[[], Any], max_waiting_requests: int = 256) -> AsyncLLMEngine:
        """Start the step thread, build the engine there with `factory()` and return once it is built;
        what `factory` raises is raised here. `start()` then lets that thread begin stepping."""
        built: concurrent.futures.Future = concurrent.futures.Future()

        def thread_main() -> None:
            try:
                async_engine = cls(factory(), max_waiting_requests)
            except BaseException as e:  # noqa: BLE001 - handed to the caller of build()
                built.set_exception(e)
                return
            built.set_result(async_engine)
            async_engine._go.wait()
            if async_engine._loop is not None:  # shut down before it ever started: nothing to run
                async_engine._run()

        thread = threading.Thread(target=thread_main, name="engine-step", daemon=True)
        thread.start()
        async_engine = built.result()
        async_engine._thread = thread
        return async_engine

    # ------------------------------------------------------------ event-loop side

    def start(self) -> None:
        """Start the step thread; call from the event loop that will consume the outputs."""
        self._loop = asyncio.get_running_loop()
        self._accepting = True
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="engine-step", daemon=True)
            self._thread.start()
        self._go.set()

    @property
    def stats(self) -> Any:
        """The engine's EngineStats after its latest step or command (never computed on the loop)."""
        return self._stats

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def num_unstarted(self) -> int:
        """Accepted requests without a first token yet: the bounded "waiting queue"."""
        return sum(not stream.started for stream in self._streams.values())

    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def step_running_s(self) -> float | None:
        """How long the current step has been running; None between steps (a stall detector)."""
        started = self._step_started
        return None if started is None else time.monotonic() - started

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       cache_salt: str | None = None, resume: Resume | None = None,
                       first_token: FirstToken | None = None,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[StepOutput]:
        """Outputs of one request until it finishes (each of its n choices, told apart by `index`).
        Closing the iterator early aborts the request; `resume` continues another engine's stream;
        `first_token` is its first output token as a P/D prefill node sampled it (LLMEngine.add_request).

        Raises EngineShutdownError / EngineOverloadedError before the first output, ValueError
        when the engine rejects the request, RequestAbortedError when the server aborts it.
        """
        if not self._accepting:
            raise EngineShutdownError("the server is shutting down")
        if (waiting := self.num_unstarted) >= self.max_waiting_requests:
            raise EngineOverloadedError(f"{waiting} requests are already waiting "
                                        f"(limit {self.max_waiting_requests}); retry later")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in flight")
        stream = _Stream(request_id, len(prompt_token_ids), num_open_choices=params.n)
        self._streams[request_id] = stream
        self._commands.put(("add", request_id, prompt_token_ids, params, cache_salt, stream.arrival, resume,
                            first_token, lora_request))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine already dropped it
                    raise item
                if item.finished:
                    stream.num_open_choices -= 1
                finished = stream.num_open_choices == 0
                yield item
                if finished:
                    return
        finally:
            self._forget(stream)
            if not finished:
                self.abort(request_id)

    async def reset_prefix_cache(self) -> bool:
        """The engine's reset_prefix_cache, run on the step thread between two steps (the engine is not
        thread-safe); its answer."""
        return await self.call(self.engine.reset_prefix_cache)

    async def call(self, fn: Callable[[], Any]) -> Any:
        """`fn()` on the step thread between two steps (the engine is not thread-safe; its OpenMP team lives
        there: loading a LoRA adapter, resetting the prefix cache); its result, or its exception."""
        done = asyncio.get_running_loop().create_future()
        self._commands.put(("call", fn, done))
        return await done

    def abort(self, request_id: str) -> None:
        """Abort a request (client gone): the step thread frees its blocks before the next step."""
        self._commands.put(("abort", request_id))

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Refuse new requests, let in-flight ones finish for up to `timeout`, abort the rest, stop."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self._streams:
            logger.info("shutdown: aborting %d in-flight requests after %.1f s", len(self._streams), timeout)
        for rid, stream in list(self._streams.items()):
            self._commands.put(("abort", rid))
            stream.queue.put_nowait(RequestAbortedError("the server is shutting down"))
        self._commands.put(("stop",))
        self._go.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    def _forget(self, stream: _Stream) -> None:
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]

    def _dispatch(self, outputs: list[StepOutput], stats: Any) -> None:
        """Runs on the loop: route one step's outputs to their streams, observe latencies."""
        self._stats = stats
        now = time.monotonic()
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted meanwhile
                continue
            n = len(out.new_token_ids)
            if self.metrics is not None and n:
                first = not stream.started
                self.metrics.observe_tokens(now - (stream.arrival if first else stream.last_token_time), n, first)
                if out.finished:
                    self.metrics.observe_finished(now - stream.arrival, stream.num_prompt_tokens, len(out.token_ids))
            if n:
                stream.last_token_time = now
            if n or out.finished:
                stream.started = True
            if out.error is not None:
                stream.queue.put_nowait(RequestFailedError(f"request failed: {out.error}"))
                continue
            stream.queue.put_nowait(out)

    def _fail(self, request_id: str, error: BaseException, stats: Any) -> None:
        self._stats = stats
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.queue.put_nowait(error)

    # ------------------------------------------------------------ step-thread side

    def _post(self, callback, *args) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # loop closed during interpreter shutdown
            pass

    def _run(self) -> None:
        try:
            self._step_loop()
            runner = getattr(self.engine, "model_runner", None)
            if runner is not None:  # a parallel engine's ranks stop here, on the thread that steps them
                runner.shutdown()
        except BaseException:  # a bug outside step(): stop taking requests rather than hang them
            logger.exception("engine step thread died; the server stops accepting requests")
            self._post(self._on_thread_died)

    def _on_thread_died(self) -> None:
        self._accepting = False
        for stream in self._streams.values():
            stream.queue.put_nowait(RequestAbortedError("the engine stopped unexpectedly"))

    def _step_loop(self) -> None:
        live: set[str] = set()
        while True:
            idle = not self.engine.has_unfinished_requests()
            if not self._handle_commands(live, block=idle):
                return
            if not self.engine.has_unfinished_requests():
                continue
            self.num_steps += 1
            self._step_started = time.monotonic()
            try:
                outputs = self.engine.step()
            except Exception as e:  # never let one bad step kill the server: fail what was in flight
                logger.exception("engine step failed; aborting %d requests", len(live))
                self._abort_in_engine(list(live))
                for rid in live:
                    self._post(self._fail, rid, RequestAbortedError(f"engine step failed: {e}"), self._stats)
                live.clear()
                continue
            finally:
                self._step_started = None
            live.difference_update(o.request_id for o in outputs
                                   if o.finished and not self.engine.has_request(o.request_id))
            self._post(self._dispatch, outputs, self.engine.get_stats())

    def _handle_commands(self, live: set[str], block: bool) -> bool:
        """Apply queued adds/aborts; wait for one when idle. False once asked to stop."""
        changed = False
        while True:
            try:
                cmd = self._commands.get(block=block and not changed)
            except queue.Empty:
                break
            changed = True
            if cmd[0] == "stop":
                return False
            if cmd[0] == "add":
                _, rid, ids, params, salt, arrival, resume, first_token, lora = cmd
                try:
                    self.engine.add_request(rid, ids, params, cache_salt=salt, arrival_time=arrival, resume=resume,
                                            first_token=first_token, lora_request=lora)
                    live.add(rid)
                except ValueError as e:  # the client's fault: 400
                    self._post(self._fail, rid, e, self.engine.get_stats())
                except Exception as e:
                    logger.exception("Reqid: %s, add_request failed", rid)
                    self._post(self._fail, rid, RequestAbortedError(f"could not add the request: {e}"),
                               self.engine.get_stats())
            elif cmd[0] == "call":  # a function of the engine, between steps; its result to the awaiting future
                _, fn, done = cmd
                try:
                    result = fn()
                except Exception as e:
                    logger.exception("%s failed", getattr(fn, "__name__", fn))
                    self._post(_settle, done, None, e)
                else:
                    self._post(_settle, done, result, None)
            elif cmd[0] == "abort" and cmd[1] in live:
                live.discard(cmd[1])
                self._abort_in_engine([cmd[1]])
                logger.info("Reqid: %s, aborted; KV blocks freed", cmd[1])
        if changed:
            self._post(self._dispatch, [], self.engine.get_stats())
        return True

    def _abort_in_engine(self, request_ids: list[str]) -> None:
        try:
            self.engine.abort_request(request_ids)
        except Exception:
            logger.exception("aborting %s failed", request_ids)
