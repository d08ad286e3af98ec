"""`pd-decode`: a node that loads prompt KV from the shared store and generates tokens."""
from __future__ import annotations

import sys

from pdserve.serving.node import NodeRole, node_main

ROLE = NodeRole(name="decode", kv_role="kv_consumer", http_port=8200, grpc_port=50052)


def main(argv: list[str] | None = None) -> int:
    return node_main(ROLE, argv)


if __name__ == "__main__":
    sys.exit(main())
