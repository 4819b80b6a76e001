"""What machine this is, as cache keys and benchmark reports name it, and what of it an engine uses."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path


def cpu_model() -> str:
    """This machine's CPU: ``/proc/cpuinfo``'s model name, else what ``platform`` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@dataclass(frozen=True, slots=True)
class ComputeShare:
    """What an engine's steps use of the machine it runs on: work handed to an idle engine adds
    throughput only where that compute is idle (two actors' processes on one core take turns)."""

    node: str  # the machine (a Ray node id; "" outside Ray)
    cpu_threads: int  # threads its steps use on CPU; 0: it steps on an accelerator of its own
    node_cpus: int  # CPUs its process may run on (0: unknown)

    @property
    def contends(self) -> bool:
        """Its steps share the machine's CPUs with the other engines there (as far as known)."""
        return self.cpu_threads > 0 and self.node_cpus > 0


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, which a container's cpuset limits)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 0
