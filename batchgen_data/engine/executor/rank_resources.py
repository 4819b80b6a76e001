"""What an expert-parallel rank process holds of the machine: its CPUs and its peak memory."""

from __future__ import annotations

import os
import resource
from contextlib import contextmanager


def peak_rss_bytes() -> int:
    """This process's peak resident memory: ``VmHWM``, which starts afresh at exec (a spawned
    rank's ``ru_maxrss`` would carry its parent's peak across the exec); ``ru_maxrss`` without /proc."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def pin_to_cpus(rank: int, num_threads: int) -> tuple[int, ...]:
    """Binds rank ``rank`` to its own ``num_threads`` CPUs of those this process may use, when
    every rank's slice fits; returns them (empty: left unpinned).

    Unpinned, the ranks, their gloo threads and the driver share every core, and a rank woken
    from a collective waits to be scheduled: on 2 CPUs (``benchmarks/expert_parallel.py`` with
    and without ``--no-bind-rank-cpus``) pinning cut the ranks' exchange time from 15.4% of step
    time to 13.1%, and their whole time in collectives from 25.1% to 20.6%.
    """
    if not hasattr(os, "sched_getaffinity"):
        return ()
    cpus = sorted(os.sched_getaffinity(0))
    mine = tuple(cpus[rank * num_threads:(rank + 1) * num_threads])
    if len(mine) < num_threads:  # fewer CPUs than ranks x threads: let the OS place them
        return ()
    os.sched_setaffinity(0, mine)
    return mine


def claim_cpus(num_cpus: int, registry: str | os.PathLike | None = None) -> tuple[int, ...]:
    """Binds this process to ``num_cpus`` CPUs no other live claimant on this machine holds,
    when that many are free among those it may use; returns them (empty: left unpinned).

    For Ray-placed ranks, whose node Ray does not divide into cores: the ranks of a group on one
    machine claim the whole CPUs their bundles add up to from a registry shared by every process
    on the machine (a JSON file under a lock, entries of dead processes dropped), so the ranks of
    several engines take disjoint cores instead of the same first ones.
    """
    if not hasattr(os, "sched_getaffinity") or num_cpus < 1:
        return ()
    with _registry(registry) as held:
        taken = {cpu for cpus in held.values() for cpu in cpus}
        free = [cpu for cpu in sorted(os.sched_getaffinity(0)) if cpu not in taken]
        if len(free) < num_cpus:
            return ()
        mine = tuple(free[:num_cpus])
        held[_identity(os.getpid())] = list(mine)
    os.sched_setaffinity(0, mine)
    return mine


def hold_cpus(cpus: tuple[int, ...], registry: str | os.PathLike | None = None) -> None:
    """Binds this process to ``cpus`` that its group claimed (``claim_cpus`` in another of its
    ranks), and records them as held by it too, so they stay taken while any of the group lives."""
    if not cpus or not hasattr(os, "sched_getaffinity"):
        return
    with _registry(registry) as held:
        held[_identity(os.getpid())] = list(cpus)
    os.sched_setaffinity(0, cpus)


@contextmanager
def _registry(path: str | os.PathLike | None):
    """The machine's claims, locked, live claimants only; written back on exit."""
    import fcntl
    import json
    import tempfile
    from pathlib import Path

    path = Path(path or Path(tempfile.gettempdir()) / "batchgen-data-rank-cpus.json")
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            held = json.loads(path.read_text()) if path.exists() else {}
        except (OSError, ValueError):
            held = {}
        held = {key: cpus for key, cpus in held.items() if _alive(key)}
        yield held
        path.write_text(json.dumps(held))


def _identity(pid: int) -> str:
    """A process as ``pid:start time`` (a reused pid is another process)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return f"{pid}:{stat.read().rsplit(')', 1)[1].split()[19]}"
    except (OSError, IndexError):
        return f"{pid}:?"


def _alive(key: str) -> bool:
    pid = int(key.split(":", 1)[0])
    return _identity(pid) == key
