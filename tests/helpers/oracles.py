"""The independent oracles the engine is checked against: Hugging Face transformers on the same weights
(greedy generate, beam search, logits) and vLLM's documented penalty formulas written as plain loops."""
from __future__ import annotations

from pathlib import Path

import torch


def hf_greedy(model_path, prompts: list[list[int]], max_tokens: int = 12) -> list[list[int]]:
    """HF generate one prompt at a time (no padding), stopping at EOS like our engine."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            seq = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long))
            outs.append(seq[0, len(ids):].tolist())
    return outs


def hf_beams(model, prompt: list[int], width: int, length_penalty: float, max_tokens: int,
             eos_token_id: int = 1) -> list[list[int]]:
    """HF's beam search (early_stopping False, its default): the width best sequences, each cut after its EOS."""
    with torch.inference_mode():
        seq = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             num_beams=width, num_return_sequences=width, max_new_tokens=max_tokens, do_sample=False,
                             length_penalty=length_penalty, early_stopping=False, pad_token_id=eos_token_id)
    rows = seq[:, len(prompt):].tolist()
    return [row[:row.index(eos_token_id) + 1] if eos_token_id in row else row for row in rows]


def hf_logits(path: Path, token_ids: list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """HF's logits at every position of one sequence (fp32 out, whatever the weights' dtype)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


def reference_penalties(logits: torch.Tensor, prompt: list[int], output: list[int], presence: float,
                        frequency: float, repetition: float) -> torch.Tensor:
    """vLLM's documented formulas, one token at a time."""
    out = logits.clone()
    for t in range(out.shape[0]):
        if t in prompt or t in output:
            out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
        count = output.count(t)
        out[t] -= frequency * count
        if count:
            out[t] -= presence
    return out
