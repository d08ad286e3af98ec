"""`pd-bench`: replay a workload against any OpenAI-compatible endpoint and report what it costs.

Per request it records TTFT, every inter-token gap, E2E, token counts and the prompt tokens
served from cache (`usage.prompt_tokens_details.cached_tokens`); from a pdserve endpoint's
`/metrics` it also records the KV-store hit and load counters. Results go to one JSON file
(schema in bench/schema.py), a summary table and PNG plots; `pd-bench compare` puts several
runs side by side. `make bench-pd` (bench/pd_matrix.py) runs it against pd-serve and two P/D
clusters.
"""
