"""One model runner driven step by step without a scheduler: the logits of every scheduled token, through the
runner's own batch preparation, and the check of a chunked prefill and decode steps in mixed batches against
HF's logits on the same weights."""
from __future__ import annotations

from pathlib import Path

import torch

from pdserve.engine.attention import ForwardContext, set_forward_context
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_connector import KVConnectorBase
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler_output import SchedulerOutput
from tests.helpers.oracles import hf_logits

# One KV block of the tiny test model (tests/conftest.py tiny_llama), in bytes
BLOCK_BYTES_TINY = 4 * 2 * 16 * 2 * 32 * 4  # layers x K/V x block x kv heads x head dim x fp32
ATOL = 1e-4
BLOCK = 16


def make_runner(path: Path, connector: KVConnectorBase | None = None) -> ModelRunner:
    return ModelRunner(EngineConfig.from_kwargs(str(path), kv_cache_memory="2MiB", block_size=BLOCK), connector)


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 259, (n,), generator=g).tolist()


def step(runner: ModelRunner, plan: list[tuple[Request, int]], tables: dict[str, list[int]],
         meta=None) -> dict[str, torch.Tensor]:
    """Logits of every scheduled token of one step per request, through the runner's own batch preparation."""
    so = SchedulerOutput(scheduled_requests=[r for r, _ in plan],
                         num_scheduled_tokens={r.request_id: n for r, n in plan},
                         block_tables={r.request_id: tables[r.request_id] for r, _ in plan},
                         total_num_scheduled_tokens=sum(n for _, n in plan), kv_connector_metadata=meta)
    inputs = runner.inputs.prepare(so)
    ctx = ForwardContext(inputs.attn_metadata, runner.kv_caches, runner.attn_backend)
    with torch.inference_mode(), set_forward_context(ctx):
        logits = runner.model.compute_logits(runner.model(inputs.input_ids, inputs.positions))
    starts = inputs.attn_metadata.query_start_loc_cpu  # batch order: single-token requests first
    return {r.request_id: logits[starts[b]:starts[b + 1]] for b, r in enumerate(inputs.requests)}


def check_against_hf(path: Path) -> None:
    """Chunked prefill over paged history, a full prefill and decode steps, all in mixed batches."""
    runner = make_runner(path)
    a = Request("a", prompt(37, 1), SamplingParams(temperature=0))
    b = Request("b", prompt(20, 2), SamplingParams(temperature=0))
    tables = {"a": [9, 3, 7], "b": [5, 2]}  # scattered, non-contiguous blocks
    got = {"a": [], "b": []}
    plans = [[(a, 18), (b, 20)], [(b, 1), (a, 19)], [(a, 1), (b, 1)], [(a, 1), (b, 1)]]
    for plan in plans:
        logits = step(runner, plan, tables)
        for req, _ in plan:
            got[req.request_id].append(logits[req.request_id])
        for req, n in plan:  # what the scheduler does after the step: advance, append the greedy token
            req.num_computed_tokens += n
            if req.num_computed_tokens == req.num_tokens:
                req.append_output_token(int(got[req.request_id][-1][-1].argmax()))
    for req in (a, b):
        ours = torch.cat(got[req.request_id])
        ref = hf_logits(path, req.all_token_ids)[:ours.shape[0]]
        assert ours.shape == ref.shape
        torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
