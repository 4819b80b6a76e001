"""One expert-parallel rank as a Ray actor: the same ``RankWorker`` as a local rank process,
commanded through actor calls instead of a socket.

``ray_rank_group.RayRankGroup`` makes this class a Ray actor (``ray.remote`` is applied there,
so importing this module needs no Ray) and places one per bundle of the engine's placement
group. The calls, in order: ``where`` (its node, for ordering ranks and for rank 0's address),
``free_port`` (rank 0 only: a port on its node for the rendezvous), ``start`` (join
``torch.distributed``, load this rank's experts: a ``RankReady``), then one ``run`` per driver
step, and ``shutdown``.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from batchgen_data.engine.executor.rank_protocol import RankCommand, RankReady, RankSetup, StepResult


@dataclass(frozen=True, slots=True)
class RankPlace:
    """Where a rank actor runs."""

    node_id: str  # Ray's node id
    node_ip: str  # the address Ray reaches the node at: rank 0's is the group's rendezvous address
    pid: int


class RankActor:
    """A rank inside a Ray actor (see the module docstring)."""

    def __init__(self, device_type: str):
        # DeepSpeed picks its accelerator when first imported; the model code may import it.
        os.environ.setdefault("DS_ACCELERATOR", device_type)
        self.worker = None

    def where(self) -> RankPlace:
        import ray

        return RankPlace(ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid())

    def free_port(self) -> int:
        """A TCP port free right now on this node's address (the rendezvous binds it next)."""
        import ray

        with socket.socket() as s:
            s.bind((ray.util.get_node_ip_address(), 0))
            return s.getsockname()[1]

    def start(self, setup: RankSetup) -> RankReady:
        from batchgen_data.engine.executor.rank_worker import RankWorker

        self.worker = RankWorker(setup)
        return self.worker.ready()

    def run(self, command: RankCommand) -> StepResult:
        return self.worker.run(command)

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
