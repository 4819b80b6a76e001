"""Giving the heap's freed memory back to the operating system during a long job.

An engine's steps allocate and free tensors of many sizes; glibc keeps what they free inside its
heap, fragmented between live blocks, so a job's resident memory grows with the rows it has run
(an engine probe: 1,090 -> 1,650 MiB over 16,000 one-token rows, with Python's own heap flat).
``malloc_trim(0)`` returns every free page inside the heap (``MADV_DONTNEED``), not only its
top: the same probe stays at ~1,260 MiB from 8,000 rows on, at the same speed. A trim walks the
heap (10-25 ms at ~1.2 GiB here), so ``HeapTrimmer`` does it at most every ``min_interval_s``.
Elsewhere than glibc (macOS, musl) it does nothing. Nothing happens at import.

``keep_step_buffers`` (an engine on CPU calls it once) stops the other churn: a step's large
tensors (the logits of 48 rows of a 152k vocabulary are 29 MB) freed and allocated again every
step. glibc's defaults serve them from ``mmap`` or give the heap's top back at each free, so
the next step faults every page in again: up to 64,000 minor faults (~250 MB) per 16-token job
of 48 rows, ~10% of its time, landing on whichever job the heap's history picks. With the
thresholds raised, freed buffers stay in the heap for the next step; ``malloc_trim`` (above)
still returns what a long job leaves free.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from collections.abc import Callable
from functools import cache

# Seconds between trims: a trim costs 10-25 ms, so at most ~0.5% of a busy process's time.
TRIM_INTERVAL_S = 5.0
# Step buffers up to this size come from the heap and are reused (glibc's default mmap threshold
# adapts up to 32 MiB at most, and resets when any threshold is set).
STEP_BUFFER_BYTES = 256 << 20
# Free memory the heap keeps at its top instead of giving it back at every free.
KEEP_FREE_BYTES = 256 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")


@cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def _malloc_trim() -> Callable[[int], int] | None:
    return getattr(_libc(), "malloc_trim", None)


@cache
def keep_step_buffers() -> bool:
    """Let freed step buffers up to ``STEP_BUFFER_BYTES`` stay in the heap for the next step
    (module docstring), once per process; False where there is no glibc, or where the user set
    glibc's malloc thresholds in the environment (theirs stand)."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None or any(name in os.environ for name in _USER_SETTINGS):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, STEP_BUFFER_BYTES) and mallopt(_M_TRIM_THRESHOLD, KEEP_FREE_BYTES))


def trim_heap() -> bool:
    """Return the heap's free pages to the OS now; False where there is no glibc to ask."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


class HeapTrimmer:
    """``trim_heap`` at most once every ``min_interval_s`` (``clock``: seconds, monotonic)."""

    def __init__(self, min_interval_s: float = TRIM_INTERVAL_S, clock: Callable[[], float] = time.monotonic):
        self.min_interval_s = min_interval_s
        self.clock = clock
        self._last = clock()
        self.num_trims = 0

    def maybe_trim(self) -> bool:
        """Trim if the last trim (or the start) is at least ``min_interval_s`` ago."""
        now = self.clock()
        if now - self._last < self.min_interval_s:
            return False
        self._last = now
        if trim_heap():
            self.num_trims += 1
            return True
        return False
