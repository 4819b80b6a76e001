"""One expert-parallel rank as a Ray actor: the same ``RankWorker`` as a local rank process.

``ray_rank_group.RayRankGroup`` makes this class a Ray actor (``ray.remote`` is applied there,
so importing this module needs no Ray) and places one per bundle of the engine's placement
group. Ray starts, places and ends it; the per-step commands travel over a TCP connection from
the driver to the rank's node instead of actor calls, which cost ~2 ms more per lockstep step on
2 CPUs (``benchmarks/expert_parallel.py --ranks ray,local``). The calls, in order:

0. its constructor connects to the engine's lifeline (``watch_lifeline``): the rank actors are
   detached, and end themselves and their placement group when that connection closes;
1. ``where``: its node, for numbering ranks and for rank 0's rendezvous address;
2. ``claim_cpus`` / ``hold_cpus`` (CPU ranks): cores of their own (``RayRankGroup._bind_cores``);
   ``free_port`` (rank 0 only): a port on its node for the ``torch.distributed`` rendezvous;
3. ``start``: join the process group, load this rank's experts, open a listening socket on its
   node's address; returns the ``RankReady`` and that port;
4. ``serve``: accept the driver's connection (it must send the token given at construction), then
   serve ``RankCommand`` s until told to shut down or the driver goes away. It runs until then,
   so its result is the driver's sign of life: it fails when the actor or its node dies.
"""

from __future__ import annotations

import os
import socket
import threading
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

from batchgen_data.engine.executor.rank_protocol import RankFailure, RankReady, RankSetup, send
from batchgen_data.engine.executor.token_link import accept_with_token, connect_with_token


@dataclass(frozen=True, slots=True)
class RankPlace:
    """Where a rank actor runs."""

    node_id: str  # Ray's node id
    node_ip: str  # the address Ray reaches the node at: rank 0's is the group's rendezvous address
    pid: int


class RankActor:
    """A rank inside a Ray actor (see the module docstring)."""

    def __init__(self, device_type: str, lifeline: tuple[str, int], token: bytes):
        # DeepSpeed picks its accelerator when first imported; the model code may import it.
        os.environ.setdefault("DS_ACCELERATOR", device_type)
        self.worker = None
        self.listener: socket.socket | None = None
        self.token = token
        watch_lifeline(lifeline, token)

    def where(self) -> RankPlace:
        import ray

        return RankPlace(ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid())

    def free_port(self) -> int:
        """A TCP port free right now on this node's address (the rendezvous binds it next)."""
        import ray

        with socket.socket() as s:
            s.bind((ray.util.get_node_ip_address(), 0))
            return s.getsockname()[1]

    def claim_cpus(self, num_cpus: int) -> tuple[int, ...]:
        """Claim (and bind to) whole CPUs of this machine for the group's ranks here."""
        from batchgen_data.engine.executor.rank_resources import claim_cpus

        return claim_cpus(num_cpus)

    def hold_cpus(self, cpus: tuple[int, ...]) -> None:
        """Bind to this rank's share of what the group claimed here."""
        from batchgen_data.engine.executor.rank_resources import hold_cpus

        hold_cpus(cpus)

    def start(self, setup: RankSetup) -> tuple[RankReady, int]:
        import ray

        from batchgen_data.engine.executor.rank_worker import RankWorker

        self.worker = RankWorker(setup)
        self.listener = socket.create_server((ray.util.get_node_ip_address(), 0))
        return self.worker.ready(), self.listener.getsockname()[1]

    def serve(self) -> None:
        conn = self._accept()
        try:
            self.worker.serve(conn)
        except (EOFError, BrokenPipeError, ConnectionResetError):
            return  # the driver is gone: nothing to report to
        except BaseException:  # report, then end: the driver fails the group
            try:
                send(conn, RankFailure(self.worker.rank, traceback.format_exc()))
            except OSError:
                pass
        finally:
            conn.close()

    def _accept(self) -> Connection:
        """The driver's command connection (the first that sends the token)."""
        sock = accept_with_token(self.listener, self.token)
        self.listener.close()
        return Connection(sock.detach())


def watch_lifeline(address: tuple[str, int], token: bytes) -> None:
    """Connect to the engine's lifeline and end the whole group when it closes.

    Rank actors are detached (Ray does not end them with the process that built the engine),
    because a placement group made by a Ray Data actor outlives that actor until the job ends,
    holding its bundles, and Ray can end owned actors before they remove it. So each rank holds
    a connection to the engine's process from its first moment; when that closes — the engine
    closed, its process died or was ended without running any cleanup — the rank removes the
    group's placement group (which ends every rank in it) and exits."""
    sock = connect_with_token(address, token)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):  # a vanished host: ~25 s
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    threading.Thread(target=_await_close, args=(sock,), name="batchgen-rank-lifeline", daemon=True).start()


def _await_close(sock: socket.socket) -> None:
    try:
        while sock.recv(64):
            pass
    except OSError:
        pass
    try:
        import ray
        from ray.util.placement_group import get_current_placement_group, remove_placement_group

        group = get_current_placement_group()
        if group is not None:
            remove_placement_group(group)
    finally:
        os._exit(0)
