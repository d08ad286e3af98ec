"""Structured outputs: xgrammar grammars applied as a batched token mask before sampling.

A request's StructuredOutputsParams is compiled once per engine against the tokenizer's
vocabulary (an LRU cache keyed by the canonical spec: the same schema sent again compiles
nothing) and each request gets its own matcher, advanced by every token the request accepts.
Each step the matchers of the batch's constrained rows fill one bitmask together, which masks
the logits in place (forbidden tokens -> -inf) on the logits' device. When the grammar is
complete only EOS remains allowed, so a constrained output always parses.

Specs are also checked without a tokenizer (`check_structured_outputs`), which lets the
protocol module refuse an invalid schema with a 400 in the proxy as in the nodes.
"""
from __future__ import annotations

import functools
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pdserve.engine.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import torch
    import xgrammar as xgr

    from pdserve.engine.request import Request

logger = logging.getLogger(__name__)

# Whitespace characters allowed between two JSON tokens. Unbounded (xgrammar's default) lets a model
# emit whitespace until max_tokens, a known way to get unparsable "JSON"; 16 still fits a newline plus
# the indentation of 2-space pretty-printing 7 levels deep.
MAX_WHITESPACE = 16
_LAX_STRING_CHAR = r'[^\"\\\r\n]'  # as printed in xgrammar's EBNF
_STRICT_STRING_CHAR = r'[^\0-\x1f\"\\]'
# xgrammar errors start with "[hh:mm:ss] /path/file.cc:123: " and sometimes "Check failed: (...) is false: ".
_NOISE = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*|Check failed: \(.*?\) is false:\s*")


def _clean(exc: BaseException) -> str:
    text = _NOISE.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
    return _NOISE.sub("", text).strip()


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly `choices` (vLLM's guided_choice)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def _strict_strings(grammar: xgr.Grammar) -> xgr.Grammar:
    """xgrammar (0.2.x) lets raw control characters into length-bounded strings (minLength/maxLength),
    which strict JSON parsers (Python's, JavaScript's) reject: forbid them as its other strings do."""
    import xgrammar as xgr

    text = str(grammar)
    return xgr.Grammar.from_ebnf(text.replace(_LAX_STRING_CHAR, _STRICT_STRING_CHAR)) if _LAX_STRING_CHAR in text \
        else grammar


def _schema_text(spec: StructuredOutputsParams) -> str:
    if isinstance(spec.json, dict):
        return json.dumps(spec.json)
    try:
        json.loads(spec.json)
    except ValueError as e:
        raise ValueError(f"invalid JSON schema: not valid JSON ({e})") from None
    return spec.json


def _grammar(spec: StructuredOutputsParams) -> xgr.Grammar:
    """The tokenizer-free grammar of `spec`; ValueError naming what is wrong with it."""
    import xgrammar as xgr

    kind = spec.kind
    try:
        if kind in ("json", "json_object"):  # json_object: any JSON object, as vLLM compiles it
            schema = _schema_text(spec) if kind == "json" else '{"type": "object"}'
            return _strict_strings(xgr.Grammar.from_json_schema(
                schema, any_whitespace=not spec.disable_any_whitespace, max_whitespace_cnt=MAX_WHITESPACE))
        if kind == "regex":
            return xgr.Grammar.from_regex(spec.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(spec.choice))
        return xgr.Grammar.from_ebnf(spec.grammar)
    except ValueError:
        raise
    except Exception as e:  # xgrammar raises RuntimeError with its C++ location in front
        what = {"json": "JSON schema", "regex": "regex", "choice": "choice list", "grammar": "grammar"}[kind]
        raise ValueError(f"invalid {what}: {_clean(e)}") from None


def check_structured_outputs(spec: StructuredOutputsParams) -> None:
    """Raise ValueError when `spec` cannot be compiled (no tokenizer needed)."""
    _grammar(spec)


def tokenizer_info(tokenizer: Any, vocab_size: int, eos_token_id: int | None) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary: each token id's bytes.

    Hugging Face tokenizers xgrammar knows (BPE, sentencepiece, tiktoken) go through its own
    reader. Byte-level tokenizers it does not know (ByT5: ids offset..offset+255 are the bytes)
    are described directly; their special tokens get no bytes, so the mask never allows them
    except the stop token.
    """
    import xgrammar as xgr

    stops = [eos_token_id] if eos_token_id is not None else None
    try:
        return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stops)
    except ValueError:
        offset = getattr(tokenizer, "offset", None)
        if offset is None or getattr(tokenizer, "_utf_vocab_size", None) != 256:
            raise
    vocab = [b""] * vocab_size
    for byte in range(256):
        if offset + byte < vocab_size:
            vocab[offset + byte] = bytes([byte])
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stops)


class RequestGrammar:
    """One request's position in its grammar: which tokens may come next."""

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar forbids it (the mask makes that a bug)."""
        return self.matcher.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


class StructuredOutputManager:
    """Compiles and caches grammars for one engine's tokenizer; hands out per-request matchers."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int | None, cache_size: int = 256) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.cache_hits = 0
        self.cache_misses = 0

    @functools.cached_property
    def compiler(self) -> xgr.GrammarCompiler:
        """Built on first use: reading a large vocabulary takes a moment that plain requests never pay."""
        import xgrammar as xgr

        info = tokenizer_info(self.tokenizer, self.vocab_size, self.eos_token_id)
        return xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)

    def compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar of `spec`, from the cache when it was compiled before; ValueError if invalid."""
        key = spec.key
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                self.cache_hits += 1
                return compiled
        t0 = time.perf_counter()
        compiled = self.compiler.compile_grammar(_grammar(spec))
        with self._lock:
            self.cache_misses += 1
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        logger.info("structured outputs: compiled a %s grammar in %.1f ms (%d cached)", spec.kind,
                    (time.perf_counter() - t0) * 1e3, len(self._cache))
        return compiled

    def request_grammar(self, spec: StructuredOutputsParams | None) -> RequestGrammar | None:
        return None if spec is None else RequestGrammar(self.compile(spec))


@functools.cache
def _batch_matcher() -> xgr.BatchGrammarMatcher:
    import xgrammar as xgr

    return xgr.BatchGrammarMatcher(max_threads=2)


def apply_grammar_bitmask(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    """Mask, in place, every token the grammar of each constrained row forbids next."""
    import xgrammar as xgr

    rows = [i for i, r in enumerate(requests) if r.grammar is not None and not r.grammar.is_terminated]
    if not rows:
        return
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])
    _batch_matcher().batch_fill_next_token_bitmask([requests[i].grammar.matcher for i in rows], bitmask, rows)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)
