"""The KV hand-off's log lines (docs/architecture.md, Log lines): their one wording, and the logger they go to.

`connectors/kv_metrics.py` writes them, one per event, beside the matching counters;
`connectors/kv_hits.py` (`pd-kv-hits`) reads them back. Keep the three in step.
"""
from __future__ import annotations

import logging

from pdserve.connectors.chunk_math import LoadPlan

logger = logging.getLogger(__name__)

GB = 1e9


def _rate(num_bytes: int, seconds: float) -> str:
    gbps = num_bytes / GB / seconds if seconds > 0 else 0.0
    return f"size: {num_bytes / GB:.4f} GB, cost {seconds * 1000:.1f} ms, throughput: {gbps:.3f} GB/s"


def lookup_line(request_id: str, plan: LoadPlan) -> str:
    return (f"Reqid: {request_id}, Total tokens {plan.num_tokens}, Local computed tokens: {plan.num_local}, "
            f"KV hit tokens: {plan.hit}, need to load: {plan.need_to_load}")


def load_line(request_id: str, plan: LoadPlan, num_bytes: int, seconds: float, codec: str | None = None) -> str:
    """`num_bytes`: the bytes moved (as stored: encoded, when a codec wrote them); `codec`: theirs."""
    need, got = plan.need_to_load, plan.retrieved
    return (f"Reqid: {request_id}, Retrieved {got} tokens from token {plan.aligned_start} (chunk-aligned; "
            f"{need} needed, {got - need} already local or recomputed) of {plan.num_tokens} total. "
            f"{_rate(num_bytes, seconds)}" + (f", codec: {codec}" if codec else ""))


def save_line(request_id: str, start: int, end: int, num_tokens: int, skip_leading_tokens: int,
              num_bytes: int, seconds: float) -> str:
    return (f"Reqid: {request_id}, Stored {end - start} tokens [{start}, {end}) of {num_tokens} "
            f"(skip_leading_tokens={skip_leading_tokens}). {_rate(num_bytes, seconds)}")


def fallback_line(request_id: str, reason: str, num_tokens: int) -> str:
    return f"Reqid: {request_id}, KV load failed ({reason}); recomputing {num_tokens} tokens"


def parts_note(arrived: int, expected: int) -> str:
    """Appended to a parallel engine's load or save line that some ranks' parts never reached
    (engine/parallel/kv_events.py): its sizes are those parts'."""
    return f", from {arrived} of {expected} ranks"


def adapter_note(adapter: str | None) -> str:
    """Appended to a lookup, load or save line of a request under a LoRA adapter (its name and the start of
    its fingerprint: names can be reused, KV of other weights never is); nothing for the base model."""
    return f", LoRA adapter: {adapter}" if adapter else ""
