"""Default logging for the offline API: log lines appear without the caller configuring anything.

vLLM's offline `LLM` prints its lines (start-up, progress, KV transfer) out of the box; ours
does the same for pdserve's packages when the process has not configured logging itself (the
root logger has no handlers), so an application's own setup always wins. Set
PDSERVE_CONFIGURE_LOGGING=0 to leave logging alone entirely. Servers call their own setup.
"""
from __future__ import annotations

import logging
import sys

from pdserve.common import env

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
ENV_SWITCH = env.CONFIGURE_LOGGING.name
LOGGER = "pdserve"  # every module logs under its own name, all below this one


def configure_default_logging(level: int = logging.INFO) -> bool:
    """Give pdserve's logger a stdout handler (as vLLM does) unless logging is configured
    or switched off; True if it did. Calling it again changes nothing."""
    if not env.flag(env.CONFIGURE_LOGGING):
        return False
    if logging.getLogger().handlers:
        return False
    logger = logging.getLogger(LOGGER)
    if any(getattr(h, "_pdserve_default", False) for h in logger.handlers):
        return False
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    handler._pdserve_default = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False  # an application that configures the root later gets no duplicates
    return True
