"""The suite's share of the host when pytest-xdist runs it in several worker processes (`make test`)."""
from __future__ import annotations

import os

from pdserve.common import env
from pdserve.deploy.processes import default_port_range


def claim_port_range() -> None:
    """Give this worker its own slice of the launchers' ports (PDSERVE_PORT_RANGE, inherited by every child).

    Each worker picks free ports at random and a child binds its port only seconds later (after importing
    torch): two workers drawing from one range could hand out the same port in that window."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count < 2 or env.optional(env.PORT_RANGE) is not None:
        return
    bottom, top = default_port_range()
    width = (top - bottom + 1) // count
    start = bottom + int(worker[2:]) * width
    os.environ[env.PORT_RANGE.name] = f"{start}-{start + width - 1}"
