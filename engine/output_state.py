"""The output side of one request: its text so far, what was handed out, and where stop strings cut it.

`LLMEngine` keeps one `OutputState` per running sequence; text is detokenized incrementally and
searched for stop strings only in its new part, and text that may still turn into a stop string is
held back from streaming.
"""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.outputs import Logprob
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.tokenizer import IncrementalDetokenizer


@dataclass
class OutputState:
    """Per-request bookkeeping on the output side: text so far and what was already handed out."""

    request: Request
    detokenizer: IncrementalDetokenizer
    first_token: float | None = None
    text: str = ""
    num_sent_tokens: int = 0
    num_sent_chars: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # built once the prompt is done


def stop_holdback(request: Request) -> int:
    """Characters held back while running: 0 when the stop string is part of the output anyway."""
    if request.sampling_params.include_stop_str_in_output:
        return 0
    return max((len(s) for s in request.sampling_params.stop), default=1) - 1


def cut_at_stop_string(state: OutputState, checked: int) -> str | None:
    """The stop string the text now holds (once more than min_tokens were generated), with the text cut
    right before the match, or right after it with include_stop_str_in_output; None when there is none.

    `checked` is the text length already searched: a new match must end beyond it.
    """
    request = state.request
    params = request.sampling_params
    if (not params.stop or request.status == RequestStatus.FINISHED_ABORTED
            or request.num_output_tokens <= params.min_tokens):
        return None
    start = max(0, checked - max(len(s) for s in params.stop) + 1)
    hits = [(idx, s) for s in params.stop if (idx := state.text.find(s, start)) >= 0]
    if not hits:
        return None
    idx, stop = min(hits)
    state.text = state.text[:idx + len(stop) if params.include_stop_str_in_output else idx]
    return stop


def replay(state: OutputState, token_ids: list[int], num_sent_chars: int) -> None:
    """Make `token_ids` already-sent outputs: detokenized one at a time as they were produced, so
    the text (and the stop-string and hold-back logic after it) matches the original stream."""
    request = state.request
    params = request.sampling_params
    for token in token_ids:
        # placeholders keep the per-token lists aligned; these entries are never sent again
        request.append_output_token(token, 0.0 if params.logprobs else None,
                                    [] if params.top_logprobs or params.logprob_token_ids else None)
        state.text += state.detokenizer.add_tokens([token])
    state.num_sent_tokens = len(token_ids)
    state.num_sent_chars = min(num_sent_chars, len(state.text))
