"""What machine this is, as cache keys and benchmark reports name it."""

from __future__ import annotations

import platform
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
