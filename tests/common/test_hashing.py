"""Key determinism: the same tokens give the same digests in every process; salts and models separate."""
from __future__ import annotations

import hashlib
import json
import struct
import subprocess
import sys

from pdserve.common.hashing import chunk_keys, hash_chain, chain_seed, model_fingerprint
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams

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


# The scheme, as docs/architecture.md ("Hash chain") states it, rebuilt here from hashlib and struct alone so
# that a change of the code's scheme fails instead of being checked against itself: H is blake2b with a
# 16-byte digest over its parts, each preceded by its length as a little-endian u64; a block or chunk's tokens
# are little-endian u32s; h_{-1} = H("pdserve-seed", fingerprint, cache salt or ""), h_i = H(h_{i-1}, tokens).
def _h(*parts: bytes) -> bytes:
    state = hashlib.blake2b(digest_size=16)
    for part in parts:
        state.update(struct.pack("<Q", len(part)) + part)
    return state.digest()


def _reference_chain(fingerprint: str, tokens: list[int], unit: int, salt: str | None,
                     include_partial: bool) -> list[bytes]:
    prev, out = _h(b"pdserve-seed", fingerprint.encode(), (salt or "").encode()), []
    for start in range(0, len(tokens), unit):
        piece = tokens[start:start + unit]
        if len(piece) < unit and not include_partial:
            break
        prev = _h(prev, struct.pack(f"<{len(piece)}I", *piece))
        out.append(prev)
    return out


# A fixed vector: fingerprint "0123456789abcdef" * 2, tokens 0..4, chunks of 4 (one full, one partial), no salt.
# Written out once so that a silent change of the key scheme (and with it every stored chunk's name) fails
# here even if the reference above were changed along with the code.
VECTOR_FP = "0123456789abcdef" * 2
VECTOR_KEYS = ["b9a5e3e41d4c4b5a20daac03a88a3a3e", "8d6947be86c4fd5e6bdb81deb494cb17"]


def test_chunk_keys_equal_the_fixed_vector_and_the_documented_scheme() -> None:
    assert [h.hex() for h in _reference_chain(VECTOR_FP, list(range(5)), 4, None, True)] == VECTOR_KEYS
    assert chunk_keys(VECTOR_FP, list(range(5)), 4) == VECTOR_KEYS


def test_chunk_keys_follow_the_documented_scheme_on_varied_inputs() -> None:
    # token ids across the u32 range, a salt, chunk sizes that do and do not divide the prompt
    tokens = [0, 1, 2**16, 2**31, 2**32 - 1] * 41 + [7]
    for size, salt in [(16, None), (256, None), (10, "tenant-a"), (1, ""), (1000, "x")]:
        want = [h.hex() for h in _reference_chain(VECTOR_FP, tokens, size, salt, True)]
        assert chunk_keys(VECTOR_FP, tokens, size, cache_salt=salt) == want
        assert len(want) == -(-len(tokens) // size)  # the partial last chunk has a key of its own


def test_prefix_cache_block_hashes_are_the_same_chain_over_full_blocks() -> None:
    """docs/architecture.md: block i is h_i of the same chain with the block size as unit, full blocks only;
    so where block and chunk sizes agree, a prompt's block hashes are its full chunks' keys."""
    tokens = list(range(100, 150))  # 3 full blocks of 16 and 2 tokens more
    request = Request("r", tokens, SamplingParams(max_tokens=1), eos_token_id=1, cache_salt="tenant-a")
    hashes = KVCacheManager(num_blocks=8, block_size=16, fingerprint=VECTOR_FP).block_hashes(request)
    assert hashes == _reference_chain(VECTOR_FP, tokens, 16, "tenant-a", include_partial=False)
    assert [h.hex() for h in hashes] == chunk_keys(VECTOR_FP, tokens, 16, cache_salt="tenant-a")[:3]


def test_model_fingerprint_equals_the_fixed_vector_and_covers_what_docs_say() -> None:
    """The fingerprint is H("pdserve-model", the identity as sorted-key JSON); docs/architecture.md: it covers
    the checkpoint config, dtype, layer count, KV heads and head dim, so changing any one changes it."""
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64}
    ident = {"config": config, "dtype": "float32", "num_layers": 2, "num_kv_heads": 2, "head_dim": 16,
             "tp_rank": 0, "tp_size": 1}
    want = _h(b"pdserve-model", json.dumps(ident, sort_keys=True).encode()).hex()
    assert want == FP == "5d96ff69342edf8a024a3d3f05b91225"
    assert model_fingerprint(config, "torch.float32", 2, 2, 16) == FP  # a torch dtype's name is the same model
    others = [model_fingerprint({**config, "hidden_size": 65}, "float32", 2, 2, 16),
              model_fingerprint(config, "bfloat16", 2, 2, 16), model_fingerprint(config, "float32", 3, 2, 16),
              model_fingerprint(config, "float32", 2, 1, 16), model_fingerprint(config, "float32", 2, 2, 32)]
    assert len({FP, *others}) == 1 + len(others)
