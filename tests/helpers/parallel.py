"""Shared pieces of the tensor/pipeline-parallel tests: an engine whose ranks are checked gone afterwards."""
from __future__ import annotations

import contextlib
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path

from pdserve.serving import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
TIMEOUT_S = 20  # every collective and the ranks' join: a broken rank fails a test instead of hanging it


def child_pids(pid: int | None = None) -> set[int]:
    """Live children of `pid` (this process by default), from /proc."""
    pid = os.getpid() if pid is None else pid
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found |= {int(c) for c in (task / "children").read_text().split()}
        except OSError:
            pass
    return found


def wait_gone(pids: set[int], timeout: float = 15.0) -> set[int]:
    """The pids still alive (zombies count as gone) after waiting up to `timeout`."""
    deadline = time.monotonic() + timeout
    alive = set(pids)
    while alive and time.monotonic() < deadline:
        alive = {p for p in alive if _alive(p)}
        time.sleep(0.05)
    return alive


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@contextlib.contextmanager
def parallel_llm(path: Path, tp: int = 1, pp: int = 1, **kwargs) -> Iterator[LLM]:
    """An LLM with tp x pp ranks; on leaving, the engine is shut down and its rank processes must be gone.
    `distributed_timeout_s` (TIMEOUT_S unless given) also bounds the ranks' start-up: four ranks importing
    torch on two busy cores need more than TIMEOUT_S."""
    before = child_pids()
    llm = LLM(str(path), dtype="float32", tensor_parallel_size=tp, pipeline_parallel_size=pp,
              **{"kv_cache_memory": "16MiB", "distributed_timeout_s": TIMEOUT_S, **kwargs})
    ranks = child_pids() - before
    assert len(ranks) == tp * pp - 1
    try:
        yield llm
    finally:
        llm.engine.shutdown()
        assert not wait_gone(ranks), "rank processes left behind"


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


_rng = random.Random(0)
# The hand-off tests' prompts: the first and last span several chunks (each prefill TP/PP saves, each decode loads)
HANDOFF_PROMPTS = [[_rng.randrange(3, 259) for _ in range(n)] for n in (300, 40, 600)]


def handoff_prefill(path: Path, store: str, layout: tuple[int, int]) -> None:
    with parallel_llm(path, *layout, kv_store=store, kv_role="kv_producer") as llm:
        llm.generate(HANDOFF_PROMPTS, SamplingParams(max_tokens=1, temperature=0))


def handoff_decode(path: Path, store: str, layout: tuple[int, int]) -> list:
    with parallel_llm(path, *layout, kv_store=store, kv_role="kv_consumer") as llm:
        return llm.generate(HANDOFF_PROMPTS, SamplingParams(max_tokens=8, temperature=0))
