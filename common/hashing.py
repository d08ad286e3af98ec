"""Deterministic digests: the model fingerprint and the chunk hash chain.

Every digest here is blake2b over explicit bytes, so the same inputs give the same keys
in any process on any machine (Python's `hash()` is salted per process and would
silently kill every cross-node hit).
"""
from __future__ import annotations

import hashlib
import json
import struct
from typing import Any, Iterable, Sequence

DIGEST_BYTES = 16


def digest(*parts: bytes) -> bytes:
    """blake2b-128 of the length-prefixed parts (length prefixes keep part boundaries unambiguous)."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for part in parts:
        h.update(struct.pack("<Q", len(part)))
        h.update(part)
    return h.digest()


def token_bytes(token_ids: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(token_ids)}I", *token_ids)


def model_fingerprint(model_config: dict[str, Any], dtype: str, num_layers: int, num_kv_heads: int,
                      head_dim: int) -> str:
    """Hex digest identifying whose KV this is: two models share KV only if all of this matches."""
    ident = {
        "config": model_config,
        "dtype": str(dtype).replace("torch.", ""),
        "num_layers": num_layers,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        # One engine is one shard today. The entries stay so every key keeps its value (stores
        # written earlier stay readable); tensor parallelism would put the shard's rank/size here.
        "tp_rank": 0,
        "tp_size": 1,
    }
    blob = json.dumps(ident, sort_keys=True, default=str).encode()
    return digest(b"pdserve-model", blob).hex()


def adapter_fingerprint(config: dict[str, Any], tensors: Iterable[tuple[str, bytes]]) -> str:
    """Hex digest of a LoRA adapter's content (its math-relevant config and every tensor's name and bytes,
    in the given order): KV computed under one adapter is named apart from any other's, whatever its name."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    h.update(digest(b"pdserve-lora", json.dumps(config, sort_keys=True, default=str).encode()))
    for name, data in tensors:
        h.update(digest(name.encode(), data))
    return h.hexdigest()


def chain_seed(fingerprint: str, cache_salt: str | None, lora_fingerprint: str | None = None) -> bytes:
    """h_{-1} = H(model fingerprint || cache salt [|| adapter fingerprint]): the root of every hash chain of
    one tenant and adapter. Without an adapter the parts (and so every base-model key) are what they were."""
    parts = [fingerprint.encode(), (cache_salt or "").encode()]
    if lora_fingerprint:
        parts.append(b"lora:" + lora_fingerprint.encode())
    return digest(b"pdserve-seed", *parts)


def salt_tag(cache_salt: str | None, lora_fingerprint: str | None = None) -> str | None:
    """The tag a store keyed by its own token hashes (LMCache) gets for a tenant and adapter; None for neither."""
    if not cache_salt and not lora_fingerprint:
        return None
    parts = [(cache_salt or "").encode()] + ([b"lora:" + lora_fingerprint.encode()] if lora_fingerprint else [])
    return digest(b"pdserve-salt", *parts).hex()[:16]


def hash_chain(seed: bytes, token_ids: Sequence[int], unit: int, include_partial: bool) -> list[bytes]:
    """h_i = H(h_{i-1} || tokens of unit i) over consecutive `unit`-token pieces of `token_ids`.

    Used with unit = block_size (full blocks only) for the prefix cache and unit =
    chunk_size (partial last chunk included) for the KV store.
    """
    out: list[bytes] = []
    prev = seed
    for start in range(0, len(token_ids), unit):
        piece = token_ids[start:start + unit]
        if len(piece) < unit and not include_partial:
            break
        prev = digest(prev, token_bytes(piece))
        out.append(prev)
    return out


def chunk_keys(fingerprint: str, token_ids: Sequence[int], chunk_size: int,
               cache_salt: str | None = None, lora_fingerprint: str | None = None) -> list[str]:
    """Store keys of the chunks of `token_ids`; the last chunk may be partial and covers exactly its tokens."""
    seed = chain_seed(fingerprint, cache_salt, lora_fingerprint)
    return [h.hex() for h in hash_chain(seed, token_ids, chunk_size, True)]
