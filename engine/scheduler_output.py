"""What the scheduler hands the model runner each step, and what comes back."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.engine.request import Request


@dataclass
class SchedulerOutput:
    """One step's batch. Scheduler and runner share a process, so requests travel by reference.

    For each scheduled request the runner computes tokens
    `all_token_ids[num_computed_tokens : num_computed_tokens + num_scheduled_tokens[id]]`
    (`num_computed_tokens` is advanced only after the step, in `update_from_output`).
    """

    scheduled_requests: list[Request]  # batch order: running requests first, then newly admitted
    num_scheduled_tokens: dict[str, int]  # request_id -> new tokens computed this step
    block_tables: dict[str, list[int]]  # request_id -> all block ids of the request, in order
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)  # finished/aborted since the last step
    preempted_req_ids: set[str] = field(default_factory=set)
    kv_connector_metadata: Any = None  # built by the connector's build_connector_meta
    # (source, destination) block ids to copy before this step's forward pass: the partial last
    # prompt block of a choice forked from choice 0 of an n > 1 request (full blocks are shared).
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class ModelRunnerOutput:
    """Sampled tokens of the requests whose prompt is complete this step."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, float] = field(default_factory=dict)
    top_logprobs: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # only requests that asked
    # prompt_logprobs requests: (first prompt token index covered, [(logprob, rank, top list)] per token)
    prompt_logprobs: dict[str, tuple[int, list]] = field(default_factory=dict)
    # Requests whose external KV failed to load this step: their sampled token (if any) is
    # discarded and the scheduler rewinds them to the locally computed prefix to recompute.
    failed_load_req_ids: set[str] = field(default_factory=set)
    # The connector's get_finished(): requests whose saves no longer read their blocks (the
    # blocks may be freed and a finished request's output released) and requests whose
    # background (WAITING_FOR_REMOTE_KVS) load ended, either way (failures are also in
    # failed_load_req_ids).
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
