"""What makes a new request impossible to run, checked before anything is queued (LLMEngine.add_request)."""
from __future__ import annotations

from pdserve.engine.outputs import FirstToken
from pdserve.engine.sampling_params import SamplingParams


def check_new_request(ids: list[int], done: list[int], params: SamplingParams, resumed: bool,
                      first_token: FirstToken | None, max_model_len: int, vocab_size: int) -> None:
    """ValueError with a clear message for a prompt (and resumed output `done`) that can never run."""
    if not ids:
        raise ValueError("the prompt is empty: give at least one token")
    if len(ids) + len(done) > max_model_len:
        raise ValueError(f"the prompt has {len(ids)} tokens, more than max_model_len={max_model_len}"
                         if not done else f"the prompt ({len(ids)} tokens) and the resumed output "
                         f"({len(done)} tokens) exceed max_model_len={max_model_len}")
    for name, tokens in (("prompt", ids), ("resumed output", done)):
        bad = [t for t in tokens if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{name} token ids must be integers in [0, {vocab_size}); got {bad[0]!r}")
    if resumed and (params.n > 1 or params.use_beam_search or len(done) >= params.max_tokens):
        raise ValueError("nothing to resume: " + (f"{len(done)} output tokens already reach max_tokens="
                                                  f"{params.max_tokens}" if params.n == 1 else "n > 1"))
    if first_token is not None:
        if resumed or params.n > 1 or params.use_beam_search or params.prompt_logprobs is not None:
            raise ValueError("a given first token needs n = 1, no beam search, no prompt_logprobs and no resume")
        if not 0 <= first_token.token_id < vocab_size:
            raise ValueError(f"the first token id must be in [0, {vocab_size}); got {first_token.token_id}")
    params.check_token_ids(vocab_size)
