"""An actor's membership of its stage's work pool: the coordinator's name (per Ray job and stage
config), this actor's worker id, and how the pool gets started: by the first actor to start
(``start_coordinator``, as it starts, before it loads its model), or ahead of the actors by the
driver (``start_work_pool``: ``BatchGenOperator.start_work_pool``)."""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from batchgen_data.distributed.coordinator import coordinator_name, get_or_create_coordinator
from batchgen_data.hardware import ComputeShare, usable_cpus

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PoolMembership:
    """What ``start_coordinator`` gives the actor: the stage's coordinator (a Ray actor handle)
    and this actor's worker id, registered with it."""

    coordinator: Any
    worker_id: str
    started: float  # ``time.monotonic()`` when the actor started (registered)


def _ray_ids() -> tuple[str, str | None]:
    """This process's Ray job id and actor id; ("local", None) without Ray (a test driving a
    client over an in-process coordinator)."""
    import ray

    if not ray.is_initialized():
        return "local", None
    context = ray.get_runtime_context()
    return context.get_job_id(), context.get_actor_id()


def engine_compute(config) -> ComputeShare:
    """What this actor's engine (``EngineConfig`` ``config``) uses of its machine: its node, the
    threads its steps use on CPU (none on an accelerator of its own) and the CPUs this process may
    run on; the pool hands waiting rows to an idle actor only where that adds compute
    (``distributed/compute.py``)."""
    import ray
    import torch

    node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"
    threads = torch.get_num_threads() if config.resolve_device().type == "cpu" else 0
    return ComputeShare(node, threads, usable_cpus())


def stage_coordinator_name(stage_key: str) -> str:
    return coordinator_name(_ray_ids()[0], stage_key)


def new_worker_id() -> str:
    return f"{_ray_ids()[1] or 'driver'}-{uuid.uuid4().hex[:6]}"


def start_coordinator(stage_key: str, lease_timeout_s: float) -> PoolMembership | None:
    """Create or find the stage's coordinator and register this actor with it, without waiting:
    call it as the actor starts, before it loads its model, so the coordinator's process starts
    while the actors load theirs and counts every actor from the stage's first lease on. None if
    Ray refuses (the client then retries at first use, and falls back to local runs if that
    fails too)."""
    started = time.monotonic()
    try:
        worker_id = new_worker_id()
        coordinator = get_or_create_coordinator(stage_coordinator_name(stage_key), lease_timeout_s)
        coordinator.register.remote(worker_id)
        return PoolMembership(coordinator, worker_id, started)
    except Exception as err:
        logger.warning("could not start the work pool coordinator yet: %s", err)
        return None


def start_work_pool(stage_key: str, lease_timeout_s: float) -> bool:
    """Create the stage's coordinator from the driver, ahead of its actors (which find it by
    name and register as they start): ``BatchGenOperator.start_work_pool``. Not awaited."""
    get_or_create_coordinator(stage_coordinator_name(stage_key), lease_timeout_s)
    return True
