"""Multi-LoRA serving (docs/lora.md): many PEFT adapters over one base model, mixed in one batch.

- `request.py`: `LoRARequest`, vLLM's name for "run this prompt under that adapter" (no torch).
- `adapter.py`: a loaded adapter (its low-rank pairs per linear layer, scaling, content fingerprint).
- `peft_format.py`: reading a PEFT directory into one, refusing what is not plain LoRA.
- `layers.py`: `LoRALinear`, the base linear layer plus each row group's `(x A^T) B^T * scaling`.
- `stacked.py`: the batched path of decode steps: every slot's pairs stacked per layer, a few ops per layer.
- `manager.py`: `LoRAManager`, the adapters kept loaded (LRU), the batch slots (and their stacks) and each
  step's row groups or per-row slot scalings.

The adapter's fingerprint enters the prefix-cache and store hash chains (common/hashing.py
`chain_seed`), so KV computed under one adapter is never found by another or by the base model.
"""
