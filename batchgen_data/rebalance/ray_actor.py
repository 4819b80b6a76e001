"""The coordinator as a Ray actor: named per job and stage, detached, zero CPUs; found by name by
the stage's other actors (``find_pool``, ``start_pool``: a ``RayTransport`` to it)."""

from __future__ import annotations

import hashlib

from batchgen_data.rebalance.coordinator import Coordinator
from batchgen_data.rebalance.transport import RayTransport

NAMESPACE = "batchgen"


def coordinator_name(job_id: str, stage_key: str) -> str:
    digest = hashlib.sha1(stage_key.encode()).hexdigest()[:12]
    return f"batchgen-pool-{job_id}-{digest}"


def find_coordinator(name: str):
    """The coordinator named ``name`` if it runs; None if it does not (or Ray is not running)."""
    import ray

    if not ray.is_initialized():
        return None
    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None


def get_or_create_coordinator(name: str, lease_timeout_s: float):
    import ray

    actor_cls = ray.remote(Coordinator)
    return actor_cls.options(
        name=name,
        namespace=NAMESPACE,
        get_if_exists=True,
        lifetime="detached",  # must outlive the operator actor that happened to create it
        num_cpus=0,
        max_concurrency=10_000,
    ).remote(lease_timeout_s=lease_timeout_s)


def find_pool(name: str) -> RayTransport | None:
    """A transport to the stage's coordinator named ``name`` if it runs; None if not."""
    handle = find_coordinator(name)
    return None if handle is None else RayTransport(handle)


def start_pool(name: str, lease_timeout_s: float) -> RayTransport:
    """A transport to the stage's coordinator, started now unless another actor just did."""
    return RayTransport(get_or_create_coordinator(name, lease_timeout_s))
