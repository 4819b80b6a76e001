"""What a Ray actor does when its engine dies: exit, so Ray restarts it."""

from __future__ import annotations

import logging
import os
from typing import NoReturn

logger = logging.getLogger(__name__)


def exit_for_restart() -> NoReturn:
    """End a Ray actor whose engine died, so Ray restarts it.

    Raising alone would send Ray's retries back to the dead actor forever (Ray Data LLM learned
    this); exiting the process makes Ray restart the actor and retry its batches on a healthy
    one, and the pool leases it held expire back into the pool.
    """
    logger.critical("batchgen engine died; exiting the actor so Ray restarts it", exc_info=True)
    os._exit(1)
