"""How many tokens each row drafts this step (0 included): its acceptance against the measured
cost of a longer forward. No torch.

NOTE: the model of a step. A row whose draft tokens are each accepted with probability ``p``
(given the ones before it were) yields ``1 + p + ... + p^k`` tokens from a draft of ``k``; the
step's cost grows with its query tokens ``q`` as measured on this engine (``StepCosts``: the
mean decode-step time per ``q``, read through a least-squares line over the sizes measured near
``q``; on a MoE model an extra token may wake more experts, which the measurements include).
One more draft token for the row whose next token is likeliest to be accepted is added while it
raises expected tokens per second: ``p_i^(k_i + 1) / (t(q + 1) - t(q)) > E / t(q)``. A step of many rows is dominated by
its compute, the extra token costs about what a row's token yields, and nothing is drafted; a
row whose drafts keep failing stops drafting (``p`` falls), and a row that has not drafted for
``PROBE_EVERY`` steps is probed with one token, one row in ``PROBE_EVERY`` steps of the job.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

# A row's acceptance: decayed counts of accepted and rejected draft tokens, with the job's
# acceptance so far as its prior (a new row of a job whose drafts fail does not draft).
DECAY = 0.9
JOB_DECAY = 0.99
PRIOR_WEIGHT = 2.0
PROBE_EVERY = 32
# Where fewer than two sizes near q have been measured, each extra token is assumed to cost this
# share of the nearest measured step (plain decode steps of 1..max_num_seqs rows measure most
# sizes as a job's running set shrinks, so this guess matters only early).
PRIOR_COST_PER_TOKEN = 0.15
_EMA = 0.2  # weight of a new measurement in a size's mean step time


@dataclass(slots=True)
class RowAcceptance:
    """A row's draft history (kept on the sequence by the drafter), or the job's: every row's
    drafts, decaying slower, which is a row's prior (weighted as ``PRIOR_WEIGHT`` draft tokens)."""

    accepted: float = 0.0
    rejected: float = 0.0
    steps_since_draft: int = 0
    decay: float = DECAY

    @property
    def p(self) -> float:
        """The acceptance estimate on its own evidence (1/2 before any)."""
        total = self.accepted + self.rejected
        return self.accepted / total if total else 0.5

    def p_with(self, prior: float) -> float:
        """The acceptance estimate with ``prior`` as ``PRIOR_WEIGHT`` tokens of evidence."""
        return (self.accepted + PRIOR_WEIGHT * prior) / (self.accepted + self.rejected + PRIOR_WEIGHT)

    def update(self, num_drafted: int, num_accepted: int) -> None:
        self.accepted = self.decay * self.accepted + num_accepted
        self.rejected = self.decay * self.rejected + (1 if num_accepted < num_drafted else 0)
        self.steps_since_draft = 0


def may_pay(costs: StepCosts, n: int) -> bool:
    """Whether one draft token, even one sure to be accepted, could raise the tokens per second
    of a step of ``n`` decoding rows."""
    now, more = costs.cost(n), costs.cost(n + 1)
    return now is not None and now > n * (more - now)


class StepCosts:
    """Mean measured time of decode steps by query tokens ``q``, read through a local straight
    line: neighbouring sizes differ by less than the run-to-run noise, so the cost of a few more
    tokens is the slope of a least-squares line over the sizes measured within [q/2, 2q + 4]."""

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
        line = self._line(q)
        if line is None:
            return None
        a, b = line
        return a + b * q

    def _line(self, q: int) -> tuple[float, float] | None:
        if not self._sizes:
            return None
        lo = bisect.bisect_left(self._sizes, q // 2)
        hi = bisect.bisect_right(self._sizes, 2 * q + 4)
        sizes = self._sizes[lo:hi]
        if len(sizes) < 2:  # one size (or none) near q: the nearest one and the prior slope
            near = min(self._sizes, key=lambda size: abs(size - q))
            t = self._seconds[near]
            return t - PRIOR_COST_PER_TOKEN * t * near, PRIOR_COST_PER_TOKEN * t
        times = [self._seconds[size] for size in sizes]
        mean_q, mean_t = sum(sizes) / len(sizes), sum(times) / len(times)
        var = sum((x - mean_q) ** 2 for x in sizes)
        slope = max(0.0, sum((x - mean_q) * (t - mean_t) for x, t in zip(sizes, times)) / var)
        return mean_t - slope * mean_q, slope


def paying_lengths(p: list[float], available: list[int], costs: StepCosts, k_max: int
                   ) -> tuple[list[int], int, float]:
    """The draft lengths that raise expected tokens per second (module NOTE), for rows whose
    draft tokens are each accepted with probability ``p[i]``; also the step's query tokens and
    expected tokens with them. Reads nothing but its arguments (``costs.cost(len(p))`` is set)."""
    n = len(p)
    lengths = [0] * n
    q, expected = n, float(n)
    yield_next = list(p)  # the expected tokens one more draft token adds
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
        yield_next[best] *= p[best]
    return lengths, q, expected


def choose_draft_lengths(acceptance: list[RowAcceptance], available: list[int], costs: StepCosts,
                         k_max: int, prior: float = 0.5, may_probe: bool = True) -> list[int]:
    """Draft tokens per row (``available[i]``: the most row i may draft; ``prior``: the job's
    acceptance, each row's prior; ``may_probe``: this step may probe one idle row)."""
    n = len(acceptance)
    if n == 0 or costs.cost(n) is None:
        return [0] * n
    lengths, q, expected = paying_lengths([a.p_with(prior) for a in acceptance], available, costs, k_max)
    # One row that has not drafted for ``PROBE_EVERY`` of its steps is probed with one token
    # (at most once in ``PROBE_EVERY`` steps of the job: the drafter says when), where a draft
    # at even odds would pay at this step's size: a proposer that failed may have started to
    # fit (an output that begins to repeat its input).
    now, more = costs.cost(q), costs.cost(q + 1)
    probe = may_probe and 0.5 * now > expected * (more - now)
    for i, a in enumerate(acceptance):
        if lengths[i] == 0:
            a.steps_since_draft += 1
            if probe and a.steps_since_draft >= PROBE_EVERY and available[i] > 0:
                lengths[i] = 1
                a.steps_since_draft = 0
                probe = False
    return lengths
