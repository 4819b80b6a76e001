"""What a Ray actor does when its engine dies: exit, so Ray restarts it."""

from __future__ import annotations

import logging
import os
from typing import NoReturn

logger = logging.getLogger(__name__)


def exit_for_restart(err: BaseException) -> NoReturn:
    """End a Ray actor whose engine died, so Ray restarts it; anywhere else, raise ``err``.

    Raising alone would send Ray's retries back to the dead actor forever (Ray Data LLM learned
    this); exiting the process makes Ray restart the actor and retry its batches on a healthy
    one, and the pool leases it held expire back into the pool. Outside a Ray actor (the CLI's
    local run, a notebook calling the operator) there is nobody to restart the process: exiting
    would kill the caller without a word, so the error goes to the caller instead.
    """
    if not in_ray_actor():
        raise err
    logger.critical("batchgen engine died; exiting the actor so Ray restarts it", exc_info=err)
    os._exit(1)


def in_ray_actor() -> bool:
    """Whether this code runs inside a Ray actor (where Ray restarts a process that exits)."""
    try:
        import ray

        return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
    except Exception:  # no Ray, or no runtime context: not an actor
        return False
