"""Whether work handed to an idle worker adds throughput: where the workers' engines step on the
CPUs of one machine, a worker that starts stepping beside busy ones only takes turns with them
once their threads fill the machine's CPUs.

Measured on the skew grid (issue #33; 2 cores, 3 actors of 1 thread each): spreading the rows
over the third actor made all three step at once, each step ~25% slower, and the job 0.89x of
the time without rebalancing, where nothing could be gained. Engines on accelerators of their
own, and engines whose machine is unknown, always add compute.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from batchgen_data.hardware import ComputeShare


def adds_compute(worker: str, shares: Mapping[str, ComputeShare], busy: Collection[str]) -> bool:
    """Whether ``worker`` would step beside the ``busy`` workers without taking turns with
    them: it is busy already (it adds no process), its engine has compute of its own, or its
    machine's CPUs have room for its threads beside those of the busy workers there.

    Example:
        >>> cpu = {w: ComputeShare("node-1", cpu_threads=1, node_cpus=2) for w in "abc"}
        >>> adds_compute("b", cpu, busy={"a"}), adds_compute("c", cpu, busy={"a", "b"})
        (True, False)
    """
    mine = shares.get(worker)
    if worker in busy or mine is None or not mine.contends:
        return True
    used = sum(share.cpu_threads for w, share in ((w, shares.get(w)) for w in busy)
               if share is not None and share.node == mine.node)
    return used + mine.cpu_threads <= mine.node_cpus


def joining(candidates: Iterable[str], shares: Mapping[str, ComputeShare], busy: Iterable[str]) -> set[str]:
    """Of the idle ``candidates``, those that would add compute if they all started, taken in
    order: each one that fits counts as busy for the next (the stage's members that can share
    the work that waits)."""
    busy = set(busy)
    joined = set()
    for worker in candidates:
        if worker in busy:
            continue
        if adds_compute(worker, shares, busy):
            busy.add(worker)
            joined.add(worker)
    return joined
