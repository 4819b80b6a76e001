"""An actor's membership of its stage's work pool: the coordinator's name (per Ray job and stage
config), this actor's worker id and start time (``join_stage``), and what its engine uses of its
machine (``engine_compute``). The pool itself starts on demand, when an actor's rows would queue
(``RebalanceClient.run_batch``)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from batchgen_data.rebalance.ray_actor import coordinator_name
from batchgen_data.hardware import ComputeShare, usable_cpus


@dataclass(frozen=True, slots=True)
class PoolMembership:
    """What ``join_stage`` gives the actor as it starts: its worker id and start time, and the
    stage's coordinator where one is given (a Ray actor handle; None: found or started on
    demand)."""

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
    (``rebalance/core/compute.py``)."""
    import ray
    import torch

    node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"
    threads = torch.get_num_threads() if config.resolve_device().type == "cpu" else 0
    return ComputeShare(node, threads, usable_cpus())


def stage_coordinator_name(stage_key: str) -> str:
    return coordinator_name(_ray_ids()[0], stage_key)


def new_worker_id() -> str:
    return f"{_ray_ids()[1] or 'driver'}-{uuid.uuid4().hex[:6]}"


def join_stage() -> PoolMembership:
    """This actor's membership, taken as it starts (before it loads its model): the pool learns
    how long its actors take to load from it."""
    return PoolMembership(None, new_worker_id(), time.monotonic())
