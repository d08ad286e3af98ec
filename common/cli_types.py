"""Argparse value types every command shares (pd-serve, the nodes, pd-proxy, the local cluster launcher):
a bad value is a one-line usage error (exit 2), never a traceback from deeper down."""
from __future__ import annotations

import argparse


def port_number(text: str) -> int:
    """A TCP port, 0..65535 (0: the system picks a free one)."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0..65535, got {text!r}")
    return port


port_number.__name__ = "port"  # argparse names the type in its message: "invalid port value"
