"""Shared pieces of the connector tests: prompts, the HF oracle, engine pairs, log-line parsing."""
from __future__ import annotations

import contextlib
import functools
import logging
import random
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from pdserve.serving import LLM, SamplingParams

LENGTHS = (1, 2, 15, 16, 17, 255, 256, 257, 511, 512, 513, 1000)
MAX_TOKENS = 4
ENGINE_KW = dict(kv_cache_memory="48MiB", chunk_size=256, load_timeout_s=5.0)
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
PREFILL = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

LOOKUP_RE = re.compile(r"Reqid: (\S+), Total tokens (\d+), Local computed tokens: (\d+), KV hit tokens: (\d+), "
                       r"need to load: (\d+)")
LOAD_RE = re.compile(r"Reqid: (\S+), Retrieved (\d+) tokens from token (\d+) \(chunk-aligned; (\d+) needed")
SAVE_RE = re.compile(r"Reqid: (\S+), Stored (\d+) tokens \[(\d+), (\d+)\) of (\d+) \(skip_leading_tokens=(\d+)\)")
FALLBACK_RE = re.compile(r"Reqid: (\S+), KV load failed \((\w+): .*\); recomputing (\d+) tokens")


def prompt(n: int, seed: int) -> list[int]:
    """n byte-token ids (3..258: never pad/eos/unk), different for every seed."""
    rng = random.Random(seed * 100_003 + n)
    return [rng.randrange(3, 259) for _ in range(n)]


@functools.lru_cache(maxsize=None)
def _hf_greedy_one(model_path: Path, ids: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    model = _hf_model(model_path)
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
        tokens = [int(out.logits[0, -1].argmax())]
        for _ in range(max_tokens - 1):
            out = model(torch.tensor([tokens[-1:]]), past_key_values=out.past_key_values, use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
    return tuple(tokens)


@functools.lru_cache(maxsize=None)
def _hf_model(model_path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def hf_greedy(model_path: Path, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """The correctness oracle: transformers on the same weights, greedy, eos ignored like `GREEDY`
    (cached per process: several test modules check the same prompts)."""
    return [list(_hf_greedy_one(model_path, tuple(ids), max_tokens)) for ids in prompts]


@functools.lru_cache(maxsize=None)
def mono_engine(model_path: Path) -> LLM:
    """A plain engine (no connector): what the consumer's output must equal."""
    return LLM(str(model_path), kv_cache_memory=ENGINE_KW["kv_cache_memory"])


def engine_pair(model_path: Path, kv_store: str, **kw) -> tuple[LLM, LLM]:
    """A producer (prefill) and a consumer (decode) engine sharing one store, in this process."""
    opts = {**ENGINE_KW, **kw}
    return (LLM(str(model_path), kv_store=kv_store, kv_role="producer", **opts),
            LLM(str(model_path), kv_store=kv_store, kv_role="consumer", **opts))


def token_ids(results) -> list[list[int]]:
    return [r.token_ids for r in results]


def prompt_tokens_computed(llm: LLM) -> int:
    return llm.engine.get_stats().num_prompt_tokens_computed


def lines(caplog, pattern: re.Pattern) -> list[tuple]:
    """Parsed groups of every captured log line matching `pattern` (numbers as ints)."""
    found = []
    for record in caplog.records:
        m = pattern.search(record.getMessage())
        if m:
            found.append(tuple(int(g) if g.isdigit() else g for g in m.groups()))
    return found


def capture(caplog) -> None:
    caplog.set_level(logging.INFO, logger="pdserve.connectors")


def check_full_handoff(producer: LLM, consumer: LLM, prompts: list[list[int]], expected: list[list[int]],
                       caplog) -> None:
    """Prefill on the producer, decode on the consumer: exact output, one prompt token computed per request."""
    capture(caplog)
    first = producer.generate(prompts, PREFILL)
    assert [r.token_ids for r in first] == [e[:1] for e in expected]
    before = prompt_tokens_computed(consumer)
    out = consumer.generate(prompts, GREEDY)
    assert token_ids(out) == expected
    assert prompt_tokens_computed(consumer) - before == len(prompts)
    sizes = [len(p) for p in prompts]
    assert [r.num_cached_tokens for r in out] == [n - 1 for n in sizes]
    # lookups and saves run in the background: their lines come in completion order
    assert sorted((t, n, h, need) for _, t, n, h, need in lines(caplog, LOOKUP_RE)) == \
        sorted((n, 0, n, n - 1) for n in sizes)
    assert sorted(saved_ranges(caplog).values()) == sorted((0, n) for n in sizes)


def saved_ranges(caplog) -> dict[str, tuple[int, int]]:
    """Request id -> the token range its save lines cover, checked contiguous (a prompt that was
    prefilled in chunks is saved in pieces, depending on how the batches fell)."""
    pieces: dict[str, list[tuple[int, int]]] = {}
    for rid, _, start, end, _, _ in lines(caplog, SAVE_RE):
        pieces.setdefault(rid, []).append((start, end))
    covered = {}
    for rid, ranges in pieces.items():
        ranges.sort()
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), (rid, ranges)
        covered[rid] = (ranges[0][0], ranges[-1][1])
    return covered


# (T, tokens the consumer served before, tokens the producer stored) -> (N, H, need, aligned_start, retrieved)
PARTIAL_CASES = [
    ((600, 290, 600), (288, 600, 311, 256, 344)),  # N not chunk-aligned: 32 tokens read but already local
    ((1000, 520, 1000), (512, 1000, 487, 512, 488)),  # N chunk-aligned
    ((700, 40, 700), (32, 700, 667, 0, 700)),
    ((600, 290, 300), (288, 256, 0, None, None)),  # N > H: nothing to load
]


def check_partial_load(producer: LLM, consumer: LLM, mono: LLM, case: tuple, want: tuple, caplog,
                       seed: int) -> None:
    """The consumer holds part of the prompt locally: it loads only the rest, and says so in numbers."""
    T, served, stored = case
    N, H, need, start, retrieved = want
    full = prompt(T, seed=seed)
    consumer.generate([full[:served]], GREEDY)  # a miss: fills the consumer's local prefix cache
    producer.generate([full[:stored]], PREFILL)
    capture(caplog)
    caplog.clear()
    before = prompt_tokens_computed(consumer)
    out = consumer.generate([full], GREEDY)
    assert token_ids(out) == token_ids(mono.generate([full], GREEDY))
    (lookup,) = lines(caplog, LOOKUP_RE)
    assert lookup[1:] == (T, N, H, need)
    assert prompt_tokens_computed(consumer) - before == T - N - need
    loads = lines(caplog, LOAD_RE)
    assert [ld[1:] for ld in loads] == ([(retrieved, start, need)] if need else [])


def check_salts_never_share(producer: LLM, consumer: LLM, mono: LLM, caplog, seed: int) -> None:
    """Two cache salts on one store: tenant B misses tenant A's chunks, tenant A hits them; output exact."""
    full = prompt(300, seed=seed)
    producer.generate([full], PREFILL, cache_salt="tenant-a")
    capture(caplog)
    other = consumer.generate([full], GREEDY, cache_salt="tenant-b")
    same = consumer.generate([full], GREEDY, cache_salt="tenant-a")
    assert [lk[3] for lk in lines(caplog, LOOKUP_RE)] == [0, 300]
    assert token_ids(other) == token_ids(same) == token_ids(mono.generate([full], GREEDY))


@contextlib.contextmanager
def broken_at_load_start(connector, break_store: Callable[[], None]) -> Iterator[None]:
    """Run `break_store` right after the lookup, as the step that loads begins (then restore the hook)."""
    original = connector.start_load_kv

    def break_then_load(metadata):
        if metadata.loads:
            break_store()
        original(metadata)

    connector.start_load_kv = break_then_load
    try:
        yield
    finally:
        connector.start_load_kv = original
