"""Scheduler without a model: budgets, chunking, mixing, preemption, stops, prefix hits, connector hooks.

`SlotRunner` stands in for the model runner: it writes each computed token id into its
paged slot and, before "sampling", checks that the request's block table reads back exactly
its token history. Its next token is a pure function of the context, so any schedule
(chunked, preempted, cached) must yield the same outputs as a plain one.
"""
from __future__ import annotations

from pdserve.engine.config import EngineConfig, KVRole, ModelConfig, SchedulerConfig
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.kv_connector import KVConnectorBase, KVConnectorMetadata
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput

BS = 16
EOS = 1


def next_token(tokens: list[int]) -> int:
    return (sum(t * (i + 1) for i, t in enumerate(tokens[-8:])) + len(tokens)) % 250 + 2  # never EOS


class SlotRunner:
    def __init__(self) -> None:
        self.slots: dict[int, int] = {}
        self.fail_loads: set[str] = set()

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        out = ModelRunnerOutput()
        for r in so.scheduled_requests:
            rid, table, start = r.request_id, so.block_tables[r.request_id], r.num_computed_tokens
            end = start + so.num_scheduled_tokens[rid]
            for pos in range(start, end):
                self.slots[table[pos // BS] * BS + pos % BS] = r.all_token_ids[pos]
            if rid in self.fail_loads:
                out.failed_load_req_ids.add(rid)
                continue
            assert [self.slots.get(table[p // BS] * BS + p % BS) for p in range(end)] == r.all_token_ids[:end]
            if end == r.num_tokens:
                out.sampled_token_ids[rid] = next_token(r.all_token_ids)
        return out


def make_scheduler(num_blocks: int = 64, connector=None, max_model_len: int | None = None,
                   **sched) -> Scheduler:
    config = EngineConfig(model=ModelConfig(model="no-model"), scheduler=SchedulerConfig(**sched))
    kv = KVCacheManager(num_blocks, BS, fingerprint="ab" * 16)
    return Scheduler(config, kv, connector, max_model_len=max_model_len)


def make_request(rid: str, prompt_len: int, max_tokens: int = 6, offset: int = 0, **params) -> Request:
    tokens = [(offset + 7 * i) % 250 + 2 for i in range(prompt_len)]
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, **params), eos_token_id=EOS)


def run(scheduler: Scheduler, requests: list[Request], runner: SlotRunner | None = None,
        ) -> tuple[dict[str, list[int]], list[SchedulerOutput]]:
    runner = runner or SlotRunner()
    for r in requests:
        scheduler.add_request(r)
    steps = []
    while scheduler.has_unfinished_requests():
        so = scheduler.schedule()
        assert so.total_num_scheduled_tokens <= scheduler.config.max_num_batched_tokens
        assert len(scheduler.running) <= scheduler.config.max_num_seqs
        scheduler.update_from_output(so, runner.execute_model(so))
        steps.append(so)
        assert len(steps) < 1000, "scheduler made no progress"
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks
    return {r.request_id: r.output_token_ids for r in requests}, steps


def reference(prompt_lens: list[int], max_tokens: int = 6) -> dict[str, list[int]]:
    outs, _ = run(make_scheduler(num_blocks=512, max_num_batched_tokens=100000),
                  [make_request(f"r{i}", n, max_tokens, offset=i) for i, n in enumerate(prompt_lens)])
    return outs


def test_token_budget_chunks_prompts_and_mixes_decode_with_prefill():
    lens = [100, 30, 5]
    sched = make_scheduler(max_num_batched_tokens=64)
    outs, steps = run(sched, [make_request(f"r{i}", n, offset=i) for i, n in enumerate(lens)])
    assert outs == reference(lens)
    assert steps[0].num_scheduled_tokens == {"r0": 64}
    assert steps[1].num_scheduled_tokens == {"r0": 36, "r1": 28}
    assert steps[2].num_scheduled_tokens == {"r0": 1, "r1": 2, "r2": 5}  # a decode beside two prefills
    assert all(len(o) == 6 for o in outs.values())


def test_long_prefill_threshold_caps_each_chunk():
    lens = [100, 40]
    sched = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=24)
    outs, steps = run(sched, [make_request(f"r{i}", n, offset=i) for i, n in enumerate(lens)])
    assert outs == reference(lens)
    assert steps[0].num_scheduled_tokens == {"r0": 24, "r1": 24}
    assert max(n for so in steps for n in so.num_scheduled_tokens.values()) == 24


def test_max_num_seqs_limits_running_requests():
    lens = [10, 20, 30, 40]
    sched = make_scheduler(max_num_seqs=2)
    outs, steps = run(sched, [make_request(f"r{i}", n, offset=i) for i, n in enumerate(lens)])
    assert outs == reference(lens)
    assert max(len(so.scheduled_requests) for so in steps) == 2


def test_preemption_recomputes_the_newest_request():
    lens = [30, 30, 30]
    sched = make_scheduler(num_blocks=7)  # 112 slots for 3 x (30 + 20) tokens
    requests = [make_request(f"r{i}", n, max_tokens=20, offset=i) for i, n in enumerate(lens)]
    outs, steps = run(sched, requests)
    assert outs == reference(lens, max_tokens=20)
    assert sched.num_preemptions > 0
    first = next(so for so in steps if so.preempted_req_ids)
    assert first.preempted_req_ids == {"r2"}  # the newest running request goes first
    assert requests[2].num_preemptions >= 1 and requests[0].num_preemptions == 0
    assert sched.num_prompt_tokens_computed > sum(lens)  # the victim's prompt ran twice


def test_preempted_request_returns_to_the_front_of_waiting():
    sched = make_scheduler(num_blocks=4)
    a, b, c = (make_request(x, 32, max_tokens=10, offset=i) for i, x in enumerate("abc"))
    for r in (a, b):
        sched.add_request(r)
    runner = SlotRunner()
    so = sched.schedule()
    sched.update_from_output(so, runner.execute_model(so))
    sched.add_request(c)
    so = sched.schedule()  # a and b each need a third block: b is preempted
    assert so.preempted_req_ids == {"b"} and [r.request_id for r in so.scheduled_requests] == ["a"]
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert sched.kv_cache_manager.get_block_ids("b") == []


def test_stop_conditions():
    def one(req: Request, token: int, **kw) -> Request:
        sched = make_scheduler(**kw)
        sched.add_request(req)
        so = sched.schedule()
        sched.update_from_output(so, ModelRunnerOutput(sampled_token_ids={req.request_id: token}))
        return req

    assert one(make_request("eos", 5), EOS).status == RequestStatus.FINISHED_STOPPED
    assert one(make_request("ign", 5, ignore_eos=True), EOS).status == RequestStatus.RUNNING
    stopped = one(make_request("stid", 5, stop_token_ids=[42]), 42)
    assert stopped.finish_reason == "stop" and stopped.stop_reason == 42
    assert one(make_request("len", 5, max_tokens=1), 42).finish_reason == "length"
    assert one(make_request("mml", 8), 42, max_model_len=9).finish_reason == "length"
    assert one(make_request("ok", 8), 42, max_model_len=10).status == RequestStatus.RUNNING


def test_full_prefix_hit_still_computes_the_last_token():
    sched, runner = make_scheduler(), SlotRunner()
    run(sched, [make_request("a", 48)], runner)
    same, longer = make_request("same", 48), make_request("longer", 49)
    outs, steps = run(sched, [same, longer], runner)
    assert steps[0].num_scheduled_tokens == {"same": 16, "longer": 1}
    assert same.num_cached_tokens == 32 and longer.num_cached_tokens == 48
    assert outs["longer"] == reference([49])["r0"]
    kv = sched.kv_cache_manager
    assert kv.prefix_cache_queries == 48 + 48 + 49 and kv.prefix_cache_hits == 32 + 48
    assert sched.num_prompt_tokens_computed == 48 + 16 + 1


def test_abort_frees_blocks_of_running_and_waiting_requests():
    sched = make_scheduler(max_num_seqs=1)
    a, b = make_request("a", 40), make_request("b", 40)
    sched.add_request(a)
    sched.add_request(b)
    so = sched.schedule()
    sched.update_from_output(so, SlotRunner().execute_model(so))
    assert sched.kv_cache_manager.num_free_blocks < 64
    assert sched.finish_requests(["a", "b", "unknown"], RequestStatus.FINISHED_ABORTED) == [a, b]
    assert a.finish_reason == "abort" and not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.num_free_blocks == 64
    assert sched.schedule().finished_req_ids == {"a", "b"}


class RecordingConnector(KVConnectorBase):
    """Scheduler half only: offers `external` extra tokens and records every hook call."""

    def __init__(self, external: int) -> None:
        super().__init__(KVRole.CONSUMER)
        self.external = external
        self.calls: list[tuple] = []
        self.kv: KVCacheManager | None = None

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.calls.append(("match", request.request_id, num_computed_tokens))
        return min(self.external, request.num_tokens - 1 - num_computed_tokens), False

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.calls.append(("alloc", request.request_id, len(block_ids), num_external_tokens))

    def build_connector_meta(self, scheduler_output):
        self.calls.append(("meta", scheduler_output.total_num_scheduled_tokens))
        return KVConnectorMetadata()

    def request_finished(self, request, block_ids):
        self.calls.append(("finished", request.request_id, len(block_ids)))
        return False, None

    def register_kv_caches(self, kv_caches): ...
    def start_load_kv(self, metadata): ...
    def wait_for_layer_load(self, layer_idx): ...
    def save_kv_layer(self, layer_idx, kv_cache, metadata): ...
    def wait_for_save(self): ...


def test_connector_hooks_and_failed_load_rewind():
    conn = RecordingConnector(external=0)
    sched, runner = make_scheduler(connector=conn), SlotRunner()
    run(sched, [make_request("warm", 20)], runner)  # puts 16 tokens in the local prefix cache
    conn.calls.clear()
    conn.external = 32
    req = make_request("r", 60, max_tokens=2)
    sched.add_request(req)
    so = sched.schedule()
    assert conn.calls[:3] == [("match", "r", 16), ("alloc", "r", 4, 32), ("meta", 12)]
    assert so.num_scheduled_tokens == {"r": 12} and req.num_computed_tokens == 48
    assert (req.num_local_computed_tokens, req.num_external_computed_tokens) == (16, 32)
    runner.fail_loads.add("r")
    sched.update_from_output(so, runner.execute_model(so))
    # rewound to the local hit, the sampled token dropped, nothing beyond it cached
    assert req.num_computed_tokens == 16 and req.output_token_ids == [] and req.num_cached_tokens == 16
    assert sched.kv_cache_manager.get_computed_blocks(make_request("probe", 60))[1] == 16
    runner.fail_loads.clear()
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"r": 44}
    sched.update_from_output(so, runner.execute_model(so))
    while sched.has_unfinished_requests():
        so = sched.schedule()
        sched.update_from_output(so, runner.execute_model(so))
    assert conn.calls[-1] == ("finished", "r", 4)  # told before the blocks were freed
    assert sched.num_failed_loads == 1
