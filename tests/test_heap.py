"""``heap.py``: a trim returns the heap's free pages inside it (not only at its top), and the
trimmer keeps to its interval."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from batchgen_data.heap import HeapTrimmer

glibc = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")

# Run in a fresh process: in a large one (torch loaded, many threads) glibc may serve these
# blocks from mmap or from another arena, and the heap's state is the other tests' as well.
_FRAGMENT_AND_TRIM = """
import ctypes, json, os
from batchgen_data.heap import trim_heap

def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

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
allocated = rss_mib()
for block in big:
    libc.free(block)
fragmented = rss_mib()
trimmed = TRIM and trim_heap()
print(json.dumps({"allocated": allocated, "fragmented": fragmented, "after": rss_mib(), "trimmed": trimmed}))
"""


def _fragment(trim: bool) -> dict:
    code = _FRAGMENT_AND_TRIM.replace("TRIM and", f"{trim} and")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc
def test_a_trim_returns_free_pages_pinned_between_live_blocks():
    untrimmed = _fragment(trim=False)
    assert untrimmed["fragmented"] > untrimmed["allocated"] - 20  # freed, but pinned: still resident
    trimmed = _fragment(trim=True)
    assert trimmed["trimmed"]
    assert trimmed["after"] < trimmed["fragmented"] - 100  # ~190 MiB of free pages between the pins go back


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


_STEP_BUFFERS = """
import ctypes, json, resource
from batchgen_data.heap import keep_step_buffers

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
kept = KEEP and keep_step_buffers()
faults = []
for _ in range(5):  # a step's 40 MiB buffer, allocated, written and freed each step
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(40 << 20)
    libc.memset(block, 1, 40 << 20)
    libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"kept": kept, "faults": faults}))
"""


def _step_buffers(keep: bool, env: dict | None = None) -> dict:
    import os

    code = _STEP_BUFFERS.replace("KEEP and", f"{keep} and")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                         env={**os.environ, **(env or {})})
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc
def test_a_freed_step_buffer_is_reused_without_faulting_its_pages_in_again():
    default = _step_buffers(keep=False)
    assert min(default["faults"][1:]) > 5000  # glibc maps 40 MiB afresh every time: ~10,240 pages
    kept = _step_buffers(keep=True)
    assert kept["kept"]
    assert max(kept["faults"][1:]) < 100  # the heap keeps it: only the first step faults it in
    assert not _step_buffers(keep=True, env={"GLIBC_TUNABLES": ""})["kept"]  # the user's settings stand
