"""Store I/O never holds a step: a slow or frozen store costs the requests that need it their own time.

Real redis-server behind deploy.fault_relay (every reply held back `delay_s`), engines driven step
by step in this process: while one request waits on a lookup, a load or a save, another keeps
decoding with short steps, and every output stays exact.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest
import torch

from pdserve.deploy.fault_relay import FaultRelay
from pdserve.serving import LLM, SamplingParams
from pdserve.engine.request import RequestStatus
from tests.helpers.connector import ENGINE_KW, FALLBACK_RE, GREEDY, PREFILL, capture, lines, mono_engine, prompt
from tests.helpers.timing import HANG_S

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

STREAM = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
SLOW_REPLY_S = 1.0  # "slow": every redis reply this late
FROZEN_REPLY_S = 60.0  # "frozen": no reply within any deadline below
FROZEN_LOOKUP_S = 1.5  # the consumer's lookup deadline with the store frozen (new connections cost round trips)
FROZEN_SAVE_S = 1.0  # the producer's lookup and save deadlines with the store frozen
# A step that waited on the store lasts at least the shortest wait it could have had here: a slow reply or
# a deadline. A step that waits for nothing takes milliseconds, beside a busy neighbour on a slow machine
# hundreds at most: what is told apart is a wait, not a speed.
STALL_S = min(SLOW_REPLY_S, FROZEN_LOOKUP_S, FROZEN_SAVE_S)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Step times are the measurement here: one intra-op thread keeps them steady on a busy machine
    (two spinning OpenMP threads per step slow a tiny model's step 10x when other processes compete)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture()
def relay(redis_module):
    relay = FaultRelay("127.0.0.1", redis_module.port)
    relay.start()
    yield relay
    relay.stop()


def engine(model, url: str, role: str, **kw) -> LLM:
    return LLM(str(model), kv_store=url, kv_role=role, **{**ENGINE_KW, **kw})


@dataclass
class Run:
    """What happened while stepping: each step's duration and when each request produced tokens."""

    steps: list[float] = field(default_factory=list)
    token_times: dict[str, list[float]] = field(default_factory=dict)
    finished: dict[str, float] = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)
    statuses: set = field(default_factory=set)

    def tokens_between(self, rid: str, start: float, end: float) -> int:
        return sum(start <= t <= end for t in self.token_times.get(rid, []))


def drive(llm: LLM, until: str, watch: str | None = None, timeout_s: float = HANG_S, run: Run | None = None) -> Run:
    """Step the engine until request `until` finishes; record step times (and `watch`'s statuses)."""
    run = run or Run()
    deadline = time.monotonic() + timeout_s
    while until not in run.finished:
        assert time.monotonic() < deadline, f"{until} did not finish in {timeout_s}s"
        started = time.perf_counter()
        outputs = llm.engine.step()
        run.steps.append(time.perf_counter() - started)
        now = time.monotonic()
        for out in outputs:
            run.token_times.setdefault(out.request_id, []).extend([now] * len(out.new_token_ids))
            if out.finished:
                run.finished[out.request_id] = now
                run.outputs[out.request_id] = out
        if watch and watch in llm.engine.scheduler.requests:
            run.statuses.add(llm.engine.scheduler.requests[watch].status)
    return run


def check_no_step_waited(run: Run) -> None:
    """No step lasted as long as a wait on the store: the I/O ran beside the steps."""
    steps = sorted(run.steps)
    assert steps[-1] < STALL_S, (f"a step took {steps[-1]:.2f} s (median {steps[len(steps) // 2] * 1e3:.1f} ms): "
                                 f"it waited on the store")


def check_stream_prefix(llm: LLM, mono: LLM, rid: str, seed: int, run: Run) -> None:
    """Abort the stream (unless it finished); the tokens it produced equal a plain engine's first tokens."""
    if rid in run.outputs:
        got = list(run.outputs[rid].token_ids)
    else:
        got = list(llm.engine.scheduler.requests[rid].output_token_ids)
        llm.engine.abort_request(rid)
    want = mono.generate([prompt(40, seed=seed)], SamplingParams(max_tokens=len(got), temperature=0.0,
                                                                 ignore_eos=True))[0].token_ids
    assert got == want


def start_stream(llm: LLM, rid: str, seed: int) -> Run:
    """A long decode on `llm`, stepped until it produced a few tokens."""
    llm.engine.add_request(rid, prompt(40, seed=seed), STREAM)
    run = Run()
    while len(run.token_times.get(rid, [])) < 3:
        for out in llm.engine.step():
            run.token_times.setdefault(out.request_id, []).extend([time.monotonic()] * len(out.new_token_ids))
    return run


@pytest.mark.parametrize("mode", ["slow", "frozen"])
def test_lookup_and_load_never_stall_a_running_stream(tiny_llama, redis_module, relay, mode, caplog):
    """slow: every redis reply 1 s late, the load still succeeds (parked in WAITING_FOR_REMOTE_KVS);
    frozen: no reply within load_timeout_s, the request recomputes. Either way the stream beside it
    keeps stepping in milliseconds and both outputs equal a plain engine's."""
    timeout_s = 12.0 if mode == "slow" else FROZEN_LOOKUP_S
    producer = engine(tiny_llama, redis_module.url, "producer")
    consumer = engine(tiny_llama, f"redis://127.0.0.1:{relay.port}/0", "consumer", load_timeout_s=timeout_s)
    try:
        full = prompt(300, seed=70 if mode == "slow" else 71)
        producer.generate([full], PREFILL)
        run = start_stream(consumer, "stream", seed=72)
        capture(caplog)
        relay.delay_s = SLOW_REPLY_S if mode == "slow" else FROZEN_REPLY_S
        added = time.monotonic()
        consumer.engine.add_request("late", full, GREEDY)
        run = drive(consumer, "late", watch="late", run=run)
        relay.delay_s = 0.0
        waited = run.finished["late"] - added
        check_no_step_waited(run)
        assert waited >= (2 * SLOW_REPLY_S if mode == "slow" else timeout_s)  # lookup + load, or the lookup deadline
        assert run.tokens_between("stream", added, run.finished["late"]) >= 10  # it kept decoding meanwhile
        mono = mono_engine(tiny_llama)
        assert run.outputs["late"].token_ids == mono.generate([full], GREEDY)[0].token_ids
        if mode == "slow":
            assert RequestStatus.WAITING_FOR_REMOTE_KVS in run.statuses
            assert run.outputs["late"].num_cached_tokens == 299  # loaded, not recomputed
            assert not lines(caplog, FALLBACK_RE)
        else:
            assert [(reason, n) for _, reason, n in lines(caplog, FALLBACK_RE)] == [("timeout", 299)]
        check_stream_prefix(consumer, mono, "stream", seed=72, run=run)
    finally:
        producer.engine.shutdown()
        consumer.engine.shutdown()


@pytest.mark.parametrize("mode", ["slow", "frozen"])
def test_saves_never_stall_a_running_stream(tiny_llama, redis_module, relay, mode, caplog):
    """slow: the prefill reply (the finished output) waits for its commit, which lands; frozen: it waits
    save_timeout_s, then goes without it. The stream on the same producer never waits."""
    producer = engine(tiny_llama, f"redis://127.0.0.1:{relay.port}/0", "producer", load_timeout_s=12.0,
                      save_timeout_s=12.0 if mode == "slow" else FROZEN_SAVE_S)
    checker = engine(tiny_llama, redis_module.url, "consumer")
    try:
        run = start_stream(producer, "stream", seed=73)
        full = prompt(300, seed=74 if mode == "slow" else 75)
        caplog.set_level("INFO")
        relay.delay_s = SLOW_REPLY_S if mode == "slow" else FROZEN_REPLY_S
        if mode == "frozen":
            producer.engine.connector.load_timeout_s = FROZEN_SAVE_S  # the lookup gives up too: save every chunk
        added = time.monotonic()
        producer.engine.add_request("prefill", full, PREFILL)
        run = drive(producer, "prefill", run=run)
        waited = run.finished["prefill"] - added
        check_no_step_waited(run)
        assert run.tokens_between("stream", added, run.finished["prefill"]) >= 10
        present = checker.engine.connector.lookup_hit(_probe(full))
        if mode == "slow":
            assert waited >= 2 * SLOW_REPLY_S  # lookup, then puts + commit
            assert present == 300  # committed before the reply
        else:
            # The lookup's deadline, then the save's, not early. What comes on top is steps of milliseconds:
            # twice the deadlines leaves a slow machine its margin and still fails a wait for the frozen
            # replies, or a deadline per layer (4 of them).
            assert 2 * FROZEN_SAVE_S <= waited < 4 * FROZEN_SAVE_S, waited
            assert "KV save failed (timeout" in caplog.text
        relay.delay_s = 0.0
        check_stream_prefix(producer, mono_engine(tiny_llama), "stream", seed=73, run=run)
    finally:
        producer.engine.shutdown()
        checker.engine.shutdown()


def _probe(token_ids: list[int]):
    from pdserve.engine.request import Request

    return Request("probe", token_ids, GREEDY)


@pytest.mark.parametrize("kv_load_mode", ["layerwise", "auto"])
def test_other_load_modes_are_exact(tiny_llama, redis_module, kv_load_mode, caplog):
    """layerwise loads inside the forward pass; auto does so only for a request alone in its step."""
    producer = engine(tiny_llama, redis_module.url, "producer")
    consumer = engine(tiny_llama, redis_module.url, "consumer", kv_load_mode=kv_load_mode)
    try:
        prompts = [prompt(n, seed=76) for n in (17, 300, 513)]
        producer.generate(prompts, PREFILL)
        capture(caplog)
        out = consumer.generate(prompts, GREEDY)
        assert [o.token_ids for o in out] == [o.token_ids for o in mono_engine(tiny_llama).generate(prompts, GREEDY)]
        assert [o.num_cached_tokens for o in out] == [16, 299, 512]
        assert not lines(caplog, FALLBACK_RE)
    finally:
        producer.engine.shutdown()
        consumer.engine.shutdown()


def test_a_request_the_sampler_cannot_prepare_fails_alone(tiny_llama):
    """A seed out of int64 range (only reachable by mutating validated params) fails at add_request,
    and a request failed by the engine ends with finish_reason "error" while its neighbour goes on."""
    llm = mono_engine(tiny_llama)
    run = start_stream(llm, "neighbour", seed=77)
    bad = SamplingParams(max_tokens=4, temperature=1.0, seed=1)
    bad.seed = 2**63
    with pytest.raises(ValueError, match="seed"):
        llm.engine.add_request("bad-seed", prompt(10, seed=78), bad)
    llm.engine.add_request("doomed", prompt(10, seed=79), STREAM)
    llm.engine.step()
    out = llm.engine.fail_request("doomed", "RuntimeError: boom")
    assert (out.finished, out.finish_reason, out.error) == (True, "error", "RuntimeError: boom")
    for _ in range(5):
        for out in llm.engine.step():
            assert out.request_id != "doomed"
    assert "doomed" not in llm.engine.scheduler.requests
    check_stream_prefix(llm, llm, "neighbour", seed=77, run=run)
