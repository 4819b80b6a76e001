"""``heap.py``: a trim returns the heap's free pages inside it (not only at its top), and the
trimmer keeps to its interval."""

from __future__ import annotations

import ctypes
import os
import sys

import pytest

from batchgen_data.heap import HeapTrimmer, trim_heap

glibc = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@glibc
def test_a_trim_returns_free_pages_pinned_between_live_blocks():
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    big, pins = [], []
    for _ in range(3000):  # 64 KiB blocks (below the mmap threshold), each followed by a small live block
        block = libc.malloc(64 << 10)
        libc.memset(block, 1, 64 << 10)  # resident
        big.append(block)
        pins.append(libc.malloc(64))
    for block in big:
        libc.free(block)
    fragmented = _rss_mib()
    try:
        assert trim_heap()
        assert _rss_mib() < fragmented - 100  # ~190 MiB of free pages between the pins go back
    finally:
        for pin in pins:
            libc.free(pin)


def test_the_trimmer_trims_at_most_once_per_interval():
    now = [0.0]
    trimmer = HeapTrimmer(min_interval_s=5.0, clock=lambda: now[0])
    assert not trimmer.maybe_trim()
    now[0] = 4.9
    assert not trimmer.maybe_trim()
    now[0] = 5.0
    assert trimmer.maybe_trim() == sys.platform.startswith("linux")
    now[0] = 9.0
    assert not trimmer.maybe_trim()
