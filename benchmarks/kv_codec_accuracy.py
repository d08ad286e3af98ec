"""What the lossy stored KV codecs cost in output, on the real model: each codec against raw, through a P/D pair.

For each codec (`?codec=` of the store, kvstore/payload_codecs.py) a producer engine prefills every prompt into a
fresh file store and a consumer engine (prefix caching off, so every prompt token but the last comes from the
store) decodes `--max-tokens` greedy tokens with the chosen tokens' logprobs. Against the raw codec's run:

- agree: prompts whose first max-tokens tokens equal raw's exactly; mean agreeing prefix (tokens before the
  first difference, max-tokens when none);
- mean |d logprob|: the mean absolute difference of the chosen tokens' logprobs, over the positions where
  both runs still agree (after a divergence the contexts differ and the number means nothing);
- the store's compression ratio (raw bytes of the KV / bytes stored, `pd-kvstore stats`) on this model's
  real KV, and the bytes each load moved.

SmolLM2-135M-Instruct (the `smollm2` preset) over real chat prompts (benchmarks/chat_workload.py):
    .venv/bin/python benchmarks/kv_codec_accuracy.py [--prompts 50] [--max-tokens 64] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

from pdserve.engine.real_model import real_model_path
from pdserve.kvstore import open_store
from pdserve.serving import LLM, SamplingParams

from chat_workload import chat_prompts

CODECS = ["raw", "lossless", "int8", "fp8"]


def run(model: Path, prompts: list[list[int]], codec: str, max_tokens: int, root: Path
        ) -> tuple[list[list[int]], list[list[float]], float, int, float]:
    """(tokens, chosen logprobs, compression ratio, stored bytes, seconds) of one codec's P/D run."""
    url = f"file://{root / codec}?codec={codec}"
    opts = dict(kv_cache_memory="512MiB", chunk_size=256, load_timeout_s=60.0, save_timeout_s=60.0)
    producer = LLM(str(model), kv_store=url, kv_role="producer", **opts)
    producer.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0))
    producer.engine.shutdown()
    consumer = LLM(str(model), kv_store=url, kv_role="consumer", enable_prefix_caching=False, **opts)
    started = time.perf_counter()
    outs = consumer.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                                     logprobs=0))
    seconds = time.perf_counter() - started
    computed = consumer.engine.get_stats().num_prompt_tokens_computed
    consumer.engine.shutdown()
    if computed != len(prompts):  # every prompt token but the last must have come from the store
        raise SystemExit(f"{codec}: {computed} prompt tokens computed, expected {len(prompts)}: a load failed")
    tokens = [out.outputs[0].token_ids for out in outs]
    logprobs = [[step[tok].logprob for step, tok in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]
                for out in outs]
    with open_store(f"file://{root / codec}") as store:
        usage = next(iter(store.inventory().values()))
    return tokens, logprobs, usage.compression_ratio, usage.bytes, seconds


def compare(base: tuple[list[list[int]], list[list[float]]], got: tuple[list[list[int]], list[list[float]]],
            max_tokens: int) -> tuple[int, float, float]:
    """(prompts identical to base, mean agreeing prefix, mean |d logprob| over the agreeing positions)."""
    same, prefixes, deltas = 0, [], []
    for want, have, want_lp, have_lp in zip(base[0], got[0], base[1], got[1]):
        prefix = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), min(len(want), len(have)))
        same += want == have
        prefixes.append(prefix)
        deltas.extend(abs(a - b) for a, b in zip(want_lp[:prefix], have_lp[:prefix]))
    return same, sum(prefixes) / len(prefixes), (sum(deltas) / len(deltas) if deltas else 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--codecs", nargs="+", default=CODECS, choices=CODECS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    model = real_model_path("smollm2", args.dtype)
    prompts = chat_prompts(model, args.prompts)
    codecs = ["raw", *[c for c in args.codecs if c != "raw"]]
    results = {}
    with tempfile.TemporaryDirectory(prefix="kv-codec-accuracy-") as tmp:
        for codec in codecs:
            results[codec] = run(model, prompts, codec, args.max_tokens, Path(tmp))
    lengths = sorted(len(p) for p in prompts)
    print(f"SmolLM2-135M-Instruct {args.dtype}, {len(prompts)} chat prompts ({lengths[0]}-{lengths[-1]} tokens, "
          f"median {lengths[len(lengths) // 2]}), {args.max_tokens} greedy tokens each, P/D through a file store")
    print(f"{'codec':9} {'stored MB':>9} {'ratio':>6} {'identical':>10} {'agreeing prefix':>16} "
          f"{'mean |d logprob|':>17} {'decode s':>9}")
    for codec in codecs:
        tokens, logprobs, ratio, stored, seconds = results[codec]
        same, prefix, delta = compare(results["raw"][:2], (tokens, logprobs), args.max_tokens)
        print(f"{codec:9} {stored / 1e6:>9.2f} {ratio:>5.2f}x {same:>5}/{len(prompts):<4} {prefix:>16.1f} "
              f"{delta:>17.5f} {seconds:>9.1f}")


if __name__ == "__main__":
    main()
