"""The rank processes of one expert-parallel engine: start, command in lockstep, detect death, stop.

Each rank is a fresh interpreter (``python -m batchgen_data.engine.executor.rank_worker``; spawned,
never forked: the parent holds torch and thread pools) talking to the driver over its own socket
pair. The group is in lockstep by construction: ``step`` sends one command to every rank and
collects one answer from each before returning.

A rank that exits, errors or stays silent past ``rank_timeout_s`` makes the whole group fail:
``EngineDeadError`` for the caller, and every surviving rank is killed (they may be blocked in
an all-to-all waiting for the dead one). Ranks also exit by themselves when their driver goes
away (end of file on the socket), so no rank outlives the process that started it.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
import weakref
from dataclasses import asdict
from multiprocessing.connection import Connection
from pathlib import Path

from batchgen_data.config import EngineConfig
from batchgen_data.engine.executor.rank_answers import RankLost, ask_to_stop, collect, exchange
from batchgen_data.engine.executor.rank_protocol import RankCommand, RankReady, RankSetup, StepResult, send
from batchgen_data.errors import EngineDeadError

logger = logging.getLogger(__name__)

# Loading a shard, joining the group and (the first time on a machine) DeepSpeed building its
# CPU communication op (~35 s) all happen before a rank is ready.
_STARTUP_TIMEOUT_S = 600.0
_STOP_GRACE_S = 5.0


class RankGroup:
    """``world_size`` rank processes serving one engine."""

    def __init__(self, model_path: str | Path, config: EngineConfig, world_size: int):
        self.world_size = world_size
        self.timeout_s = config.rank_timeout_s
        self.device_type = config.resolve_device().type  # DeepSpeed's accelerator for the ranks
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        self._closed = False
        self._finalizer = weakref.finalize(self, _kill, self.procs)
        port = _free_port()
        threads = max(1, _num_threads() // world_size)
        settings = asdict(config)
        if settings["bind_rank_cpus"] is None:
            settings["bind_rank_cpus"] = not _in_ray_worker()
        try:
            for rank in range(world_size):
                self._start_rank(RankSetup(str(model_path), settings, rank, world_size, port, threads))
            self.ready: list[RankReady] = self._collect(_STARTUP_TIMEOUT_S, "start")
        except BaseException:
            self.close(kill=True)
            raise

    def _start_rank(self, setup: RankSetup) -> None:
        ours, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.setdefault("DS_ACCELERATOR", self.device_type)
        proc = subprocess.Popen(
            [sys.executable, "-m", "batchgen_data.engine.executor.rank_worker", "--fd", str(theirs.fileno())],
            pass_fds=[theirs.fileno()], env=env, stdout=subprocess.DEVNULL,  # stderr stays: their errors
        )
        theirs.close()
        self.procs.append(proc)
        conn = Connection(ours.detach())
        send(conn, setup)
        self.conns.append(conn)

    def step(self, commands: list[RankCommand]) -> list[StepResult]:
        """One command to every rank, one answer from each (in rank order)."""
        if self._closed:
            raise EngineDeadError("the expert-parallel rank group was shut down")
        try:
            return exchange(self.conns, commands, self.timeout_s, self._dead_rank)
        except RankLost as lost:
            self._fail(str(lost))

    def _collect(self, timeout_s: float, what: str) -> list:
        try:
            return collect(self.conns, timeout_s, what, self._dead_rank)
        except RankLost as lost:
            self._fail(str(lost))

    def _dead_rank(self, owing: set[int]) -> str | None:
        dead = sorted(r for r in owing if self.procs[r].poll() is not None)
        return f"rank {dead[0]} exited (exit status {self.procs[dead[0]].poll()})" if dead else None

    def _fail(self, reason: str):
        self.close(kill=True)
        raise EngineDeadError(f"expert-parallel engine failed: {reason}")

    def close(self, kill: bool = False) -> None:
        """Stop every rank: ask politely (unless ``kill``), then kill what is left."""
        if self._closed:
            return
        self._closed = True
        if not kill:
            ask_to_stop(self.conns)
            deadline = time.monotonic() + _STOP_GRACE_S
            for proc in self.procs:
                try:
                    proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        _kill(self.procs)
        for conn in self.conns:
            conn.close()
        self._finalizer.detach()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        try:
            proc.wait(_STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            logger.warning("rank process %d did not exit after SIGKILL", proc.pid)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _in_ray_worker() -> bool:
    """Inside a Ray worker (an actor or task) process, whose node's CPUs other workers share."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return False
    try:
        return ray.get_runtime_context().worker.mode == ray.WORKER_MODE
    except AttributeError:  # an older or newer runtime context: assume a worker
        return True


def _num_threads() -> int:
    import torch

    return torch.get_num_threads()
