"""Key determinism: the same tokens give the same digests in every process; salts and models separate."""
from __future__ import annotations

import subprocess
import sys

from pdserve.common.hashing import chunk_keys, hash_chain, chain_seed, model_fingerprint

FP = model_fingerprint({"architectures": ["LlamaForCausalLM"], "hidden_size": 64}, "float32", 2, 2, 16)
TOKENS = list(range(600))


def test_chunk_keys_are_identical_in_another_process() -> None:
    code = ("from common.hashing import chunk_keys, model_fingerprint;"
            "fp = model_fingerprint({'architectures': ['LlamaForCausalLM'], 'hidden_size': 64}, 'float32', 2, 2, 16);"
            "print(','.join(chunk_keys(fp, list(range(600)), 256)))")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "12345"}).stdout.strip().split(",")
    assert other == chunk_keys(FP, TOKENS, 256)


def test_partial_last_chunk_has_its_own_key() -> None:
    keys = chunk_keys(FP, TOKENS, 256)
    assert len(keys) == 3  # 256 + 256 + 88
    longer = chunk_keys(FP, list(range(700)), 256)
    assert longer[:2] == keys[:2] and longer[2] != keys[2]


def test_salt_and_model_separate_keys() -> None:
    other_fp = model_fingerprint({"architectures": ["LlamaForCausalLM"], "hidden_size": 64}, "bfloat16", 2, 2, 16)
    assert other_fp != FP
    base = chunk_keys(FP, TOKENS, 256)
    assert not set(base) & set(chunk_keys(other_fp, TOKENS, 256))
    assert not set(base) & set(chunk_keys(FP, TOKENS, 256, cache_salt="tenant-a"))


def test_block_chain_covers_only_full_blocks() -> None:
    seed = chain_seed(FP, None)
    assert len(hash_chain(seed, TOKENS[:47], 16, include_partial=False)) == 2
    assert hash_chain(seed, TOKENS[:32], 16, False) == hash_chain(seed, TOKENS[:47], 16, False)
