"""The bottom of pdserve's package graph: small pure helpers that every package may import.

`hashing` (the prefix-cache and store hash chains, the model fingerprint), `units` (byte
sizes), `eventloop` (the event loop a process runs on) and `paths` (the cache directory). Nothing here imports another pdserve package, torch or a store client, so importing it
is cheap everywhere (docs/architecture.md).
"""
