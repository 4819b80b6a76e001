"""Collecting one answer from every rank over its connection, whichever way the ranks started.

Local ranks (``rank_group.py``) answer over a socket pair, Ray-placed ranks
(``ray_rank_group.py``) over a TCP connection from the driver to the rank's node: both send
``RankCommand`` s and read ``StepResult`` s with ``rank_protocol.send`` / ``recv``. Whenever
nothing arrives for ``POLL_S``, ``collect`` asks the group's own liveness check (a process's
exit status, an actor's death as Ray reports it), so a rank that dies where its connection cannot say
so (a machine gone without closing its sockets) still fails the step promptly.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

from batchgen_data.engine.executor.rank_protocol import RankCommand, RankFailure, recv, send

POLL_S = 0.2  # how often a wait checks that every rank is still alive


class RankLost(Exception):
    """A rank failed, died or stayed silent: the reason, for ``EngineDeadError``."""


def exchange(conns: list[Connection], commands: list[RankCommand], timeout_s: float,
             dead_rank: Callable[[set[int]], str | None]) -> list:
    """One lockstep step: every command sent, then every answer collected (``RankLost``)."""
    try:
        for conn, command in zip(conns, commands):
            send(conn, command)
    except OSError as err:
        raise RankLost(f"a rank stopped reading its commands ({err})") from None
    return collect(conns, timeout_s, "step", dead_rank)


def ask_to_stop(conns: list[Connection]) -> None:
    """Tell every rank to shut down (those already gone are skipped)."""
    for conn in conns:
        try:
            send(conn, RankCommand(step=False, shutdown=True))
        except OSError:
            pass


def collect(conns: list[Connection], timeout_s: float, what: str,
            dead_rank: Callable[[set[int]], str | None]) -> list:
    """One answer from each connection, in rank order; ``RankLost`` on a ``RankFailure``, end
    of file, ``dead_rank(ranks still owing an answer)`` naming one, or the deadline."""
    answers: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    while len(answers) < len(conns):
        pending = [c for r, c in enumerate(conns) if r not in answers]
        ready = wait(pending, timeout=POLL_S)
        for conn in ready:
            rank = conns.index(conn)
            try:
                answer = recv(conn)
            except (EOFError, OSError) as err:
                raise RankLost(f"rank {rank} closed its connection during {what} "
                               f"({dead_rank({rank}) or type(err).__name__})") from None
            if isinstance(answer, RankFailure):
                raise RankLost(f"rank {rank} failed during {what}:\n{answer.error}")
            answers[rank] = answer
        owing = set(range(len(conns))) - set(answers)
        reason = dead_rank(owing) if owing and not ready else None  # on a quiet poll only: free when ranks answer
        if reason:
            raise RankLost(reason)
        if owing and time.monotonic() > deadline:
            raise RankLost(f"ranks {sorted(owing)} did not answer a {what} within {timeout_s:.0f} s (rank_timeout_s)")
    return [answers[r] for r in range(len(conns))]
