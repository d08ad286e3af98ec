"""The bottom of pdserve's package graph: small pure helpers that every package may import.

`hashing` (the prefix-cache and store hash chains, the model fingerprint) and `units` (byte
sizes). Nothing here imports another pdserve package, torch or a store client, so importing it
is cheap everywhere (docs/architecture.md).
"""
