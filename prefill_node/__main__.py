"""`pd-prefill`: a node that computes prompts and commits their KV to the shared store."""
from __future__ import annotations

import sys

from pdserve.serving.node import NodeRole, node_main

ROLE = NodeRole(name="prefill", kv_role="kv_producer", http_port=8100, grpc_port=50051)


def main(argv: list[str] | None = None) -> int:
    return node_main(ROLE, argv)


if __name__ == "__main__":
    sys.exit(main())
