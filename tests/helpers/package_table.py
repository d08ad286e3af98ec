"""docs/architecture.md's table of which package may import which (section 1): tests/test_package_graph.py
enforces it, tests/common/test_env.py walks its packages."""
from __future__ import annotations

# package -> the first-party packages it may import
ALLOWED = {
    "common": set(),
    "kernels": {"common"},
    "protos": set(),
    "kvstore": {"common"},
    "engine": {"common", "kernels"},
    "connectors": {"common", "engine", "kernels", "kvstore"},
    "serving": {"common", "connectors", "engine", "kvstore", "protos"},
    "proxy": {"common", "protos", "serving"},
    "prefill_node": {"serving"},
    "decode_node": {"serving"},
    "deploy": {"common", "engine", "proxy"},
    "bench": {"deploy", "engine"},
}
