"""pdserve serving: everything between a client (or the proxy) and the engine.

The OpenAI protocol, HTTP server (`pd-serve`), node gRPC servicer and launcher, command-line
options and Prometheus metrics live here, so `engine/` stays free of HTTP, gRPC and
Prometheus. The package layout and its import rules: docs/architecture.md.
"""
