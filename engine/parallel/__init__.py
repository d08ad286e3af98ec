"""Tensor and pipeline parallelism (docs/parallelism.md): one process per rank on torch.distributed.

- `layout.py`: which rank holds which layers, heads and vocabulary rows (one rule for every model family);
- `sharding.py`: a rank's narrowed model config and its slice of each checkpoint tensor;
- `group.py`: the process groups a model runner owns (no process-global group), and the collectives;
- `step_codec.py`: the step, block copies and logits requests as int64 tensors (never pickle);
- `launcher.py`: rank 0 starts ranks 1..N-1 as children and supervises them;
- `driver.py`: rank 0's side of a step; `worker.py`: the other ranks' loop (`python -m pdserve.engine.parallel.worker`).
"""
