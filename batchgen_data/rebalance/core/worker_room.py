"""How many pool items a worker asks for: its engine's free running slots, and the slots about to
free (a sequence that ends within one lease round trip: the next item arrives as it ends). Pure
Python; the stage's client (``rebalance/client``) and the simulator's actors ask it."""

from __future__ import annotations

import math
from collections.abc import Iterable

from batchgen_data.rebalance.core.progress import SeqProgress


def slots_freeing_soon(seqs: Iterable[SeqProgress], step_s: float, call_s: float, max_wait_s: float,
                       ) -> tuple[int, float]:
    """Running sequences whose budget ends within one lease round trip (``call_s``; their slots
    can be leased for now), and the seconds until the next one gets that close (at most
    ``max_wait_s``; a sequence not started yet counts as starting at the next step: at the latest
    it ends then).

    Example:
        >>> seqs = [SeqProgress(14, 16, 30, True), SeqProgress(0, 64, 10, True)]
        >>> slots_freeing_soon(seqs, step_s=0.01, call_s=0.005, max_wait_s=5.0)
        (1, 0.62)
    """
    lead = 1 + math.ceil(call_s / step_s) if step_s > 0 else 1
    soon, wake_s = 0, max_wait_s
    for seq in seqs:
        left = seq.num_tokens_left + (0 if seq.started else 1)
        if seq.started and left <= lead:
            soon += 1
        else:
            wake_s = min(wake_s, max(1, left - lead) * step_s)
    return soon, wake_s
