"""SmolLM2-135M-Instruct checks: real chat prompts and the comparison with HF (fp32): token-identical to HF's
greedy output, except where HF's own top-2 logit gap at the first differing step is below NEAR_TIE (both
choices are then right to float rounding): those are counted and reported."""
from __future__ import annotations

import functools
from pathlib import Path

import torch

NEAR_TIE = 1e-4
MAX_TOKENS = 16
REPO = Path(__file__).resolve().parents[2]


def _long_text() -> str:
    """About 1,200 tokens of real prose: the start of this repository's architecture notes, whole paragraphs."""
    text = (REPO / "docs" / "architecture.md").read_text()
    return text[:text.index("\n\n", 3000)]


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# Lengths after the chat template (its default system prompt is 20 tokens): 37, 38, 60, 122, 242 and about
# 1,200 tokens: partial blocks of 16, several blocks, several 64-token chunks, and one prompt over 1,000.
CONVERSATIONS: list[list[dict[str, str]]] = [
    _user("What is the capital of France?"),
    [{"role": "system", "content": "You are a concise assistant that answers in one sentence."},
     {"role": "user", "content": "Why is the sky blue during the day and red at sunset?"}],
    _user("Write a short poem about a cat who sits by the window and watches the rain fall on the garden, "
          "dreaming of birds and summer afternoons."),
    _user("I have eggs, flour, milk, butter, sugar, a pinch of salt and some fresh strawberries. My kitchen has an "
          "oven, a frying pan and a whisk, but no mixer. Guests arrive in an hour and two of them do not eat "
          "chocolate. Suggest a dessert I can make in time, list the steps, and tell me which of my ingredients "
          "I will not need. Keep the answer short, because I need to start cooking right away."),
    _user("Read this story and answer the question after it.\n\n" + " ".join([
        "Mara had kept the lighthouse on the northern cape for eleven years.", "Every evening she climbed the "
        "ninety-two steps, trimmed the wick and polished the great lens until it shone.", "Ships passed far out "
        "at sea, and she liked to imagine where they were going: to warm harbours, to cities she had only read "
        "about, to families waiting on the docks.", "One winter a storm broke the telegraph line, and for three "
        "weeks no supply boat came.", "Mara rationed her oil, burning the lamp only in the darkest hours, and "
        "wrote every passing ship into her logbook by the light of a single candle.", "When the boat finally "
        "arrived, the young captain told her that her light had guided his crew past the rocks on the worst "
        "night of the storm.", "She said nothing, but that evening she climbed the steps a little more slowly, "
        "smiling, and let the lamp burn until morning."]) + "\n\nQuestion: why did the captain thank Mara, and "
        "what did she do that evening?"),
    _user("Summarize the following design notes in three sentences.\n\n" + _long_text()),
]


def chat_ids(tokenizer, conversation: list[dict[str, str]]) -> list[int]:
    from pdserve.engine.tokenizer import apply_chat_template

    return apply_chat_template(tokenizer, conversation)


@functools.cache
def _hf_model(model_path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()


@functools.cache
def _hf_check(model_path: Path, prompt: tuple[int, ...], output: tuple[int, ...]) -> tuple[int, float] | None:
    """None when every output token is HF's greedy choice after the prompt and the tokens before it; else
    (the first step where it is not, HF's top-1 minus top-2 logit there)."""
    with torch.inference_mode():
        logits = _hf_model(model_path)(torch.tensor([list(prompt + output)])).logits[0, len(prompt) - 1:-1]
    for k, token in enumerate(output):
        top2 = logits[k].float().topk(2)
        if int(top2.indices[0]) != token:
            return k, float(top2.values[0] - top2.values[1])
    return None


def near_ties(model_path: Path, prompts: list[list[int]], outputs: list[list[int]]) -> list[str]:
    """Each output is HF's greedy output (fp32), or first differs where HF's top-2 gap is below NEAR_TIE: those
    are returned, one line each. Any other difference fails with the step, the token and the gap.

    HF runs one forward over prompt + our output instead of generate's step by step: if every one of our
    tokens is HF's argmax given the same prefix, HF's greedy generate is our output, token for token (an
    EOS we stopped at included), at a fraction of generate's per-step cost."""
    ties = []
    for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        diff = _hf_check(model_path, tuple(prompt), tuple(output))
        if diff is None:
            continue
        step, gap = diff
        assert gap < NEAR_TIE, (f"prompt {i} ({len(prompt)} tokens): output step {step} is {output[step]}, not HF's "
                                f"greedy token (HF top-2 gap {gap:.3g})")
        ties.append(f"prompt {i}: near tie at step {step} (HF top-2 gap {gap:.2g})")
    return ties
