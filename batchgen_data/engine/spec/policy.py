"""How many tokens each row drafts this step (0 included): its acceptance against the measured
cost of a longer forward. No torch.

NOTE: the model of a step. A row whose draft tokens are each accepted with probability ``p``
(given the ones before it were) yields ``1 + p + ... + p^k`` tokens from a draft of ``k``; the
step's cost grows with its query tokens ``q`` as measured on this engine (``StepCosts``: the
mean decode-step time per ``q``, interpolated between measured sizes; on a MoE model an extra
token may wake more experts, which the measurements include). One more draft token for the row
whose next token is likeliest to be accepted is added while it raises expected tokens per
second: ``p_i^(k_i + 1) / (t(q + 1) - t(q)) > E / t(q)``. A step of many rows is dominated by
its compute, the extra token costs about what a row's token yields, and nothing is drafted; a
row whose drafts keep failing stops drafting (``p`` falls), and is probed again with one token
every ``PROBE_EVERY`` of its steps.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

# A row's acceptance: decayed counts of accepted and rejected draft tokens, from a prior of one
# of each (p = 0.5 before any evidence).
DECAY = 0.9
PROBE_EVERY = 32
# Beyond the largest query size measured so far, each extra token is assumed to cost this share
# of that size's step (plain decode steps of 1..max_num_seqs rows measure most sizes as a job's
# running set shrinks, so this guess matters only early).
PRIOR_COST_PER_TOKEN = 0.15
_EMA = 0.2  # weight of a new measurement in a size's mean step time


@dataclass(slots=True)
class RowAcceptance:
    """One row's draft history (kept on the sequence by the drafter)."""

    accepted: float = 1.0
    rejected: float = 1.0
    steps_since_draft: int = 0

    @property
    def p(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def update(self, num_drafted: int, num_accepted: int) -> None:
        self.accepted = DECAY * self.accepted + num_accepted
        self.rejected = DECAY * self.rejected + (1 if num_accepted < num_drafted else 0)
        self.steps_since_draft = 0


class StepCosts:
    """Mean measured time of decode steps by query tokens ``q``."""

    def __init__(self) -> None:
        self._sizes: list[int] = []
        self._seconds: dict[int, float] = {}

    def observe(self, q: int, seconds: float) -> None:
        old = self._seconds.get(q)
        if old is None:
            bisect.insort(self._sizes, q)
            self._seconds[q] = seconds
        else:
            self._seconds[q] = (1 - _EMA) * old + _EMA * seconds

    def cost(self, q: int) -> float | None:
        """Estimated seconds of a step of ``q`` tokens; None before any measurement."""
        if not self._sizes:
            return None
        if q in self._seconds:
            return self._seconds[q]
        i = bisect.bisect_left(self._sizes, q)
        if i == len(self._sizes):  # beyond the largest measured size: the prior slope
            top = self._sizes[-1]
            t = self._seconds[top]
            return t * (1 + PRIOR_COST_PER_TOKEN * (q - top))
        if i == 0:
            return self._seconds[self._sizes[0]]
        lo, hi = self._sizes[i - 1], self._sizes[i]
        return self._seconds[lo] + (self._seconds[hi] - self._seconds[lo]) * (q - lo) / (hi - lo)


def choose_draft_lengths(acceptance: list[RowAcceptance], available: list[int], costs: StepCosts,
                         k_max: int) -> list[int]:
    """Draft tokens per row (``available[i]``: the most row i's proposer offered)."""
    n = len(acceptance)
    lengths = [0] * n
    if n == 0 or costs.cost(n) is None:
        return lengths
    q, expected = n, float(n)
    yield_next = [a.p for a in acceptance]  # the expected tokens one more draft token adds
    while True:
        best = max((i for i in range(n) if lengths[i] < min(k_max, available[i])), key=lambda i: yield_next[i],
                   default=None)
        if best is None:
            break
        now, more = costs.cost(q), costs.cost(q + 1)
        gain = yield_next[best]
        if not gain * now > expected * (more - now):
            break
        lengths[best] += 1
        q += 1
        expected += gain
        yield_next[best] *= acceptance[best].p
    # A row that stopped drafting is probed now and then, where a draft at the prior's
    # acceptance (1/2) would pay at this step's size.
    now, more = costs.cost(q), costs.cost(q + 1)
    probe_pays = 0.5 * now > expected * (more - now)
    for i, a in enumerate(acceptance):
        if lengths[i] == 0:
            a.steps_since_draft += 1
            if probe_pays and a.steps_since_draft >= PROBE_EVERY and available[i] > 0:
                lengths[i] = 1
                a.steps_since_draft = 0
    return lengths
