"""Deterministic digests: the model fingerprint and the chunk hash chain.

Every digest here is blake2b over explicit bytes, so the same inputs give the same keys
in any process on any machine (Python's `hash()` is salted per process and would
silently kill every cross-node hit).
"""
from __future__ import annotations

import hashlib
import json
import struct
from typing import Any, Sequence

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


def chain_seed(fingerprint: str, cache_salt: str | None) -> bytes:
    """h_{-1} = H(model fingerprint || cache salt): the root of every hash chain of one tenant."""
    return digest(b"pdserve-seed", fingerprint.encode(), (cache_salt or "").encode())


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
               cache_salt: str | None = None) -> list[str]:
    """Store keys of the chunks of `token_ids`; the last chunk may be partial and covers exactly its tokens."""
    return [h.hex() for h in hash_chain(chain_seed(fingerprint, cache_salt), token_ids, chunk_size, True)]
