"""Tokenizer handling: loading, prompt encoding, chat templates and incremental detokenization."""
from __future__ import annotations

import json
import os
import weakref
from pathlib import Path
from typing import Any

REPLACEMENT_CHAR = "\ufffd"

# Python (slow) tokenizers rebuild their special-id set on every decode with skip_special_tokens:
# several times the cost of the decode itself, twice per request per step. Computed once here.
_SPECIAL_IDS: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()


def _special_ids(tokenizer: Any) -> frozenset[int]:
    ids = _SPECIAL_IDS.get(tokenizer)
    if ids is None:
        ids = _SPECIAL_IDS[tokenizer] = frozenset(tokenizer.all_special_ids)
    return ids


def eos_token_id(tokenizer: Any, hf_config: Any) -> int | None:
    """The tokenizer's EOS, else the config's (the first one when it lists several)."""
    if tokenizer.eos_token_id is not None:
        return tokenizer.eos_token_id
    eos = getattr(hf_config, "eos_token_id", None)
    return eos[0] if isinstance(eos, (list, tuple)) and eos else eos


def load_tokenizer(path: str | os.PathLike) -> Any:
    """The model directory's own tokenizer (local files only: serving never downloads).

    A directory without tokenizer.json whose tokenizer_config.json names a transformers class
    (the built-in models' ByT5Tokenizer) gets exactly that class: AutoTokenizer would pick
    the class registered for the model type instead (e.g. Qwen2Tokenizer for qwen2) and
    build a wrong vocabulary.
    """
    import transformers

    root = Path(path)
    config_file = root / "tokenizer_config.json"
    if config_file.exists() and not (root / "tokenizer.json").exists():
        declared = getattr(transformers, json.loads(config_file.read_text()).get("tokenizer_class") or "", None)
        if declared is not None:
            return declared.from_pretrained(str(root), local_files_only=True)
    return transformers.AutoTokenizer.from_pretrained(str(root), local_files_only=True)


def encode_prompt(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of a plain-text prompt.

    Special tokens are added (unless `add_special_tokens` is false) only when the tokenizer has a
    BOS token: Llama-style tokenizers then get their BOS, while tokenizers that would *append*
    EOS (ByT5) do not end every prompt with end-of-sequence.
    """
    return tokenizer.encode(text, add_special_tokens=add_special_tokens and tokenizer.bos_token is not None)


def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *,
                        continue_final_message: bool = False, chat_template_kwargs: dict[str, Any] | None = None,
                        add_special_tokens: bool = False) -> list[int]:
    """Render chat messages with the tokenizer's chat template and tokenize them (vLLM's options).

    `continue_final_message` leaves the last message open for the model to continue;
    `chat_template_kwargs` are extra template variables (e.g. enable_thinking); `add_special_tokens`
    puts the BOS in front unless the template already starts with it. A conversation the template
    refuses (its own raise_exception, an unknown role) is a ValueError with the template's message.
    """
    import jinja2

    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; use the completions API with a plain prompt")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message,
                                             **(chat_template_kwargs or {}))
    except jinja2.TemplateError as e:
        raise ValueError(f"the chat template refused these messages: {e}") from None
    # The template already contains whatever BOS the model wants.
    ids = tokenizer.encode(text, add_special_tokens=False)
    bos = tokenizer.bos_token_id
    if add_special_tokens and bos is not None and ids[:1] != [bos]:
        ids = [bos] + ids
    return ids


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Byte-level tokens can split one UTF-8 character across several tokens; decoding them
    alone yields U+FFFD. Text is emitted only once it no longer ends in U+FFFD, and each
    step decodes only a short window of recent tokens (cost independent of output length).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = list(prompt_token_ids or [])
        # Context tokens before the window start make the decoding of the window's tokens
        # correct for tokenizers whose pieces depend on their left neighbours (sentencepiece spaces).
        self.prefix_offset = max(len(self.token_ids) - 5, 0)
        self.read_offset = len(self.token_ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        tokenizer = self.tokenizer
        if self.skip_special_tokens and not getattr(tokenizer, "is_fast", False):
            # What the slow tokenizer's skip_special_tokens does (drop ids in all_special_ids), with
            # the set computed once; fast tokenizers skip in Rust, cheaply and by their own rules.
            special = _special_ids(tokenizer)
            return tokenizer.decode([i for i in ids if i not in special], skip_special_tokens=False)
        return tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the newly completed text (possibly empty)."""
        self.token_ids.extend(new_token_ids)
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset:])
        if full_text.endswith(REPLACEMENT_CHAR) or len(full_text) <= len(prefix_text):
            return ""
        delta = full_text[len(prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a request: emit whatever is pending, incomplete characters included."""
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset:])
        delta = full_text[len(prefix_text):] if full_text.startswith(prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.text += delta
        return delta
