"""The ranks of one expert-parallel engine as Ray actors in one placement group.

The same contract as ``rank_group.RankGroup`` (``ready``, ``step``, ``close``): each command goes
to every rank and one answer comes back from each before ``step`` returns. What differs is how
the ranks start and how they are reached:

1. Place: one placement group of N bundles (``EngineConfig.rank_resources``, strategy
   ``EngineConfig.placement_strategy``). A group the cluster can never hold is a ``ConfigError``
   before anything starts; one not placed within ``rank_timeout_s`` (the cluster is busy) is an
   ``EngineDeadError`` naming what it waits for.
2. Order: one ``RankActor`` per bundle; ranks are numbered by node (the nodes in the order of
   their first bundle, the bundles in order within a node), so the ranks of a node are
   consecutive and a group spans as few machines as its placement allows.
3. Rendezvous: rank 0 reports its node's IP (Ray's address for that node, routable from the
   others) and a free port there; every rank joins ``torch.distributed`` at that address with
   the collective timeout (gloo on CPU; NCCL with a gloo group beside it on CUDA).
4. Connect: each rank listens on its node's address; the driver connects to every rank (a
   random token first, so no stray connection is served) and steps go over these connections
   as over a local rank's socket pair, not as actor calls (``rank_actor.py``). Each rank's
   ``serve`` call lasts as long as the rank: Ray failing it is how a rank whose machine vanished
   without closing its socket is seen (``rank_answers.collect`` asks on every quiet poll).

One failure unit: an actor that dies (its process or its node), a rank whose step raises (a
collective that lost its peer), or an answer later than ``rank_timeout_s`` fails the group:
every actor is killed, the placement group removed, and ``EngineDeadError`` raised. The actors
are detached and end themselves, with their placement group, when the engine's lifeline closes
however its process ends (``rank_actor.watch_lifeline``).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import weakref
from dataclasses import asdict
from multiprocessing.connection import Connection

from batchgen_data.config import EngineConfig
from batchgen_data.engine.executor.rank_actor import RankActor, RankPlace
from batchgen_data.engine.executor.rank_answers import RankLost, ask_to_stop, exchange
from batchgen_data.engine.executor.rank_protocol import RankCommand, RankReady, RankSetup, StepResult
from batchgen_data.engine.executor.token_link import TOKEN_TIMEOUT_S, accept_with_token, connect_with_token
from batchgen_data.errors import ConfigError, EngineDeadError

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 600.0  # as local ranks: loading, joining, DeepSpeed's first op build
_STOP_GRACE_S = 5.0


def rank_bundle(config: EngineConfig) -> dict:
    """One rank's bundle: ``rank_resources``, else one CPU (and one GPU on CUDA)."""
    if config.rank_resources is not None:
        return dict(config.rank_resources)
    return {"CPU": 1.0, "GPU": 1.0} if config.resolve_device().type == "cuda" else {"CPU": 1.0}


def core_plan(config: EngineConfig, bundle: dict, ranks_here: int) -> tuple[int, int | None]:
    """How the group's ``ranks_here`` ranks on one machine bind to cores: (cores to claim there,
    cores each rank takes of them, None: all share them). The whole CPUs their bundles add up to
    (Ray reserves them, but does not pin): each rank its own when its bundle holds whole CPUs,
    shared when the bundles are fractional (two ranks of 0.5 CPU share one core). Nothing when
    they add up to less than one CPU, on CUDA, or with ``bind_rank_cpus=False``."""
    cpus = float(bundle.get("CPU", 0))
    if config.bind_rank_cpus is False or config.resolve_device().type != "cpu" or cpus <= 0:
        return 0, None
    if cpus >= 1 and cpus.is_integer():
        return int(cpus) * ranks_here, int(cpus)
    return int(cpus * ranks_here + 1e-9), None


def bundles_per_node(bundle: dict, nodes: list[dict]) -> list[int]:
    """How many copies of ``bundle`` each node's total resources hold (never more than that)."""
    counts = []
    for resources in nodes:
        fits = [int(resources.get(name, 0.0) / amount + 1e-9) for name, amount in bundle.items() if amount > 0]
        counts.append(min(fits) if fits else 0)
    return counts


def check_placeable(bundle: dict, world_size: int, strategy: str, nodes: list[dict]) -> None:
    """``ConfigError`` when no state of this cluster (its alive nodes' totals) holds the group."""
    counts = bundles_per_node(bundle, nodes)
    if strategy == "STRICT_PACK":
        fits = max(counts, default=0) >= world_size
    elif strategy == "STRICT_SPREAD":
        fits = sum(1 for c in counts if c >= 1) >= world_size
    else:
        fits = sum(counts) >= world_size
    if not fits:
        raise ConfigError(
            f"expert_parallel_size={world_size} ranks of {bundle} each ({strategy}) do not fit this Ray cluster: "
            f"its {len(nodes)} node(s) hold {counts} such bundles; lower rank_resources (e.g. {{'CPU': 0.5}}), "
            "change placement_strategy or add nodes")


class RayRankGroup:
    """``world_size`` rank actors serving one engine (see the module docstring)."""

    def __init__(self, model_path, config: EngineConfig, world_size: int):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.world_size = world_size
        self.timeout_s = config.rank_timeout_s
        self.device_type = config.resolve_device().type
        self.bundle = rank_bundle(config)
        self.strategy = config.placement_strategy
        self.actors: list = []
        self.places: list[RankPlace] = []
        self.conns: list[Connection] = []
        self._serving: list = []
        # [placement group, actors, sockets...]: what the finalizer releases
        self._held: list = [None, self.actors]
        self._closed = False
        self._finalizer = weakref.finalize(self, _release, self._held)
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        check_placeable(self.bundle, world_size, self.strategy, nodes)
        try:
            pg = placement_group([dict(self.bundle) for _ in range(world_size)], strategy=self.strategy)
            self._held[0] = pg
            ready, _ = ray.wait([pg.ready()], timeout=self.timeout_s)
            if not ready:
                self._fail(f"its placement group ({world_size} x {self.bundle}, {self.strategy}) was not placed "
                           f"within {self.timeout_s:.0f} s (rank_timeout_s); the cluster has "
                           f"{ray.available_resources()} available")
            token = os.urandom(32)
            lifeline = socket.create_server((ray.util.get_node_ip_address(), 0))
            self._held.append(lifeline)
            remote = ray.remote(RankActor)
            actors = [remote.options(**_actor_options(self.bundle), max_restarts=0, max_task_retries=0,
                                     lifetime="detached",  # they end with the lifeline (rank_actor.py)
                                     scheduling_strategy=PlacementGroupSchedulingStrategy(
                                         pg, placement_group_bundle_index=i)).remote(
                          self.device_type, lifeline.getsockname()[:2], token)
                      for i in range(world_size)]
            self.actors.extend(actors)
            places = self._ray_collect([a.where.remote() for a in actors], _STARTUP_TIMEOUT_S, "placement")
            self._held.extend(_accept_lifelines(lifeline, token, world_size))
            order = node_order(places)
            self.actors[:] = [actors[i] for i in order]
            self.places = [places[i] for i in order]
            self._bind_cores(config)
            port = self._ray_collect([self.actors[0].free_port.remote()], _STARTUP_TIMEOUT_S, "rendezvous")[0]
            settings = asdict(config)
            settings["bind_rank_cpus"] = False  # not by rank number (``_bind_cores`` did it)
            threads = max(1, int(self.bundle.get("CPU", 1)))
            setups = [RankSetup(str(model_path), settings, rank, world_size, port, threads,
                                master_addr=self.places[0].node_ip, device_index=0)
                      for rank in range(world_size)]
            started = self._ray_collect([a.start.remote(s) for a, s in zip(self.actors, setups)],
                                        _STARTUP_TIMEOUT_S, "start")
            self.ready: list[RankReady] = [ready for ready, _ in started]
            self._serving = [a.serve.remote() for a in self.actors]  # each ends only when its rank does
            self.conns = [Connection(connect_with_token((place.node_ip, rank_port), token).detach())
                          for place, (_, rank_port) in zip(self.places, started)]
            self._held.extend(self.conns)
        except BaseException:
            self.close(kill=True)
            raise

    def _bind_cores(self, config: EngineConfig) -> None:
        """On each machine, the first rank there claims the cores the plan gives the group's
        ranks there (``core_plan``) and every rank there binds to its share; a machine with
        too few free cores leaves its ranks unbound."""
        by_node: dict[str, list[int]] = {}
        for rank, place in enumerate(self.places):
            by_node.setdefault(place.node_id, []).append(rank)
        for ranks in by_node.values():
            cores, each = core_plan(config, self.bundle, len(ranks))
            if cores < 1:
                continue
            claimed = self._ray_collect([self.actors[ranks[0]].claim_cpus.remote(cores)], _STARTUP_TIMEOUT_S,
                                        "core claim")[0]
            if not claimed:
                continue
            shares = [claimed if each is None else claimed[i * each:(i + 1) * each] for i in range(len(ranks))]
            self._ray_collect([self.actors[r].hold_cpus.remote(tuple(c)) for r, c in zip(ranks, shares)],
                              _STARTUP_TIMEOUT_S, "core binding")

    def step(self, commands: list[RankCommand]) -> list[StepResult]:
        """One command to every rank over its connection, one answer from each (in rank order)."""
        if self._closed:
            raise EngineDeadError("the expert-parallel rank group was shut down")
        try:
            return exchange(self.conns, commands, self.timeout_s, self._dead_rank)
        except RankLost as lost:
            self._fail(str(lost))

    def _dead_rank(self, owing: set[int]) -> str | None:
        """A rank whose ``serve`` ended (its actor or node died, as Ray reports it) while it owes
        an answer."""
        import ray

        refs = [self._serving[r] for r in sorted(owing)]
        ended, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        for ref in ended:
            rank = self._serving.index(ref)
            try:
                ray.get(ref, timeout=0)
            except Exception as err:  # noqa: BLE001 - what Ray says of the actor
                return f"rank {rank}'s actor died ({type(err).__name__}: {err})"
            return f"rank {rank} stopped serving"
        return None

    def _ray_collect(self, refs: list, timeout_s: float, what: str) -> list:
        """Every actor call's value in order (start-up); the first failure, or the deadline,
        fails the group."""
        import ray
        from ray.exceptions import RayActorError, RayError, RayTaskError

        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        answers: dict[int, object] = {}
        pending = list(refs)
        deadline = time.monotonic() + timeout_s
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            for ref in done:
                rank = rank_of[ref]
                try:
                    answers[rank] = ray.get(ref, timeout=0)
                except RayTaskError as err:
                    self._fail(f"rank {rank} failed during {what}:\n{err}")
                except RayActorError as err:
                    self._fail(f"rank {rank}'s actor died during {what} ({type(err).__name__}: {err})")
                except RayError as err:
                    self._fail(f"rank {rank} failed during {what} ({type(err).__name__}: {err})")
            if pending and time.monotonic() >= deadline:
                self._fail(f"ranks {sorted(rank_of[r] for r in pending)} did not answer a {what} within "
                           f"{timeout_s:.0f} s")
        return [answers[r] for r in range(len(refs))]

    def _fail(self, reason: str):
        self.close(kill=True)
        raise EngineDeadError(f"expert-parallel engine failed: {reason}")

    def close(self, kill: bool = False) -> None:
        """Stop every rank actor (politely unless ``kill``) and remove the placement group."""
        if self._closed:
            return
        self._closed = True
        if not kill and self.conns:
            import ray

            ask_to_stop(self.conns)
            try:
                ray.wait(self._serving, num_returns=len(self._serving), timeout=_STOP_GRACE_S)
            except Exception:  # noqa: BLE001 - they are killed next either way
                pass
        _release(self._held)
        self._finalizer.detach()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.places]

    @property
    def node_ids(self) -> list[str]:
        return [p.node_id for p in self.places]


def _accept_lifelines(listener: socket.socket, token: bytes, count: int) -> list[socket.socket]:
    """The ranks' lifeline connections (each connected in its actor's constructor, so all are
    queued once every ``where`` answered)."""
    listener.settimeout(TOKEN_TIMEOUT_S)
    try:
        return [accept_with_token(listener, token) for _ in range(count)]
    finally:
        listener.close()


def node_order(places: list[RankPlace]) -> list[int]:
    """Bundle indices in rank order: nodes by their first bundle, bundles in order within a node."""
    first: dict[str, int] = {}
    for index, place in enumerate(places):
        first.setdefault(place.node_id, index)
    return sorted(range(len(places)), key=lambda i: (first[places[i].node_id], i))


def _actor_options(bundle: dict) -> dict:
    options = {"num_cpus": bundle.get("CPU", 0), "num_gpus": bundle.get("GPU", 0)}
    if "memory" in bundle:
        options["memory"] = bundle["memory"]
    custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU", "memory")}
    if custom:
        options["resources"] = custom
    return options


def _release(held: list) -> None:
    """Kill the actors and remove the placement group (quiet when Ray is already gone), then
    close the lifelines and connections: a closed lifeline makes the ranks end themselves too."""
    try:
        import ray
        from ray.util.placement_group import remove_placement_group

        if ray.is_initialized():
            for actor in held[1]:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:  # noqa: BLE001 - already dead
                    pass
            if held[0] is not None:
                remove_placement_group(held[0])
                held[0] = None
    except Exception:  # noqa: BLE001 - at interpreter exit, or Ray shut down meanwhile
        logger.debug("releasing expert-parallel rank actors failed", exc_info=True)
    finally:
        for sock in held[2:]:
            sock.close()
        del held[2:]
