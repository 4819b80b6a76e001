"""Prefix-ordered admission: which waiting sequences to try, in which order. Pure policy, no torch.

NOTE: within a window at the waiting queue's head, the sequence with the longest cached prefix
goes first (ties in arrival order); one whose next uncached block a running sequence (or one
planned before it) is computing right now is deferred, at most ``MAX_DEFERRALS`` admissions,
so siblings never compute a shared prefix twice and none starves. The plan assumes each
admission before it succeeds; the scheduler stops at the first that does not fit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchgen_data.engine.core.kv_manager import KVCacheManager
    from batchgen_data.engine.core.sequence import Sequence

# How many sequences at the head of the waiting queue are ordered by their cached prefix, per
# free running slot (bounds the per-refill lookups), and how many admissions one may wait for
# a sibling computing its next block (the starvation bound).
ADMISSION_WINDOW_PER_SLOT = 2
MAX_DEFERRALS = 8


def plan_prefix_admission(window: list[Sequence], kv: KVCacheManager, running: list[Sequence],
                          num_slots: int) -> tuple[list[Sequence], list[Sequence]]:
    """(the sequences of ``window`` to admit, in order, at most ``num_slots``; the ones deferred)."""
    hits = {id(seq): len(kv.computed_prefix(seq)) for seq in window}
    ordered = sorted(window, key=lambda seq: -hits[id(seq)])  # stable: arrival order among equals
    computing = kv.computing_names(running)
    admit: list[Sequence] = []
    deferred: list[Sequence] = []
    for seq in ordered:
        if len(admit) >= num_slots:
            break
        names, hit = kv.prefix_names(seq), hits[id(seq)]
        if hit < len(names) and names[hit] in computing and seq.num_deferrals < MAX_DEFERRALS:
            deferred.append(seq)
            continue
        admit.append(seq)
        computing.update(names[hit:])
    return admit, deferred
