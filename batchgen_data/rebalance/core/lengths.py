"""What a job's rows generate: output lengths learned from finished rows. Pure Python.

The move planner (``move_rule.py``) estimates the tokens a sequence has left from them: a row is
bounded by its ``max_tokens``, but a job whose rows stop at their end-of-sequence token after
~20 tokens should not plan as if every row ran to its 256-token limit.
"""

from __future__ import annotations

from collections import deque

from batchgen_data import budget

# Finished rows of one max_tokens kept to learn output lengths from (the latest ones).
_LENGTH_SAMPLES = 2048
# Fewer finished rows longer than a sequence's current length than this: use the max_tokens bound.
_MIN_LENGTH_SAMPLES = 4


class _LengthWindow:
    """The latest output lengths of one ``max_tokens``, with their counts and sums per length in
    Fenwick trees: the rows longer than ``n`` are counted and summed in O(log max_tokens)."""

    def __init__(self, max_tokens: int):
        self.size = max_tokens + 1  # lengths 0..max_tokens
        self.window: deque[int] = deque()
        self.sum_all = 0
        self._count = [0] * (self.size + 1)
        self._total = [0] * (self.size + 1)
        self.estimates: dict[int, float] = {}  # num_generated -> tokens left, until the next record

    def record(self, length: int) -> None:
        self.estimates.clear()
        length = min(max(length, 0), self.size - 1)
        self.window.append(length)
        self._add(length, 1)
        if len(self.window) > _LENGTH_SAMPLES:
            self._add(self.window.popleft(), -1)

    def _add(self, length: int, sign: int) -> None:
        self.sum_all += sign * length
        i = length + 1
        while i <= self.size:
            self._count[i] += sign
            self._total[i] += sign * length
            i += i & -i

    def longer_than(self, n: int) -> tuple[int, int]:
        """How many of the lengths exceed ``n``, and their sum."""
        count = total = 0
        i = min(max(n + 1, 0), self.size)  # the lengths 0..n
        while i > 0:
            count += self._count[i]
            total += self._total[i]
            i -= i & -i
        return len(self.window) - count, self.sum_all - total


class OutputLengths:
    """Output lengths of the job's finished rows, by ``max_tokens``; estimates tokens left.

    Example:
        >>> lengths = OutputLengths()
        >>> lengths.tokens_left(10, 256)  # nothing learned yet: the max_tokens bound
        246.0
        >>> for n in (18, 20, 22, 24):
        ...     lengths.record(256, n)
        >>> lengths.tokens_left(10, 256)  # the mean length of the finished rows that outlived it
        11.0
    """

    def __init__(self):
        self._by_max: dict[int, _LengthWindow] = {}

    def record(self, max_tokens: int, num_generated: int) -> None:
        window = self._by_max.get(int(max_tokens))
        if window is None:
            window = self._by_max[int(max_tokens)] = _LengthWindow(int(max_tokens))
        window.record(int(num_generated))

    def tokens_left(self, num_generated: int, max_tokens: int) -> float:
        """Expected tokens still to come: the mean remaining length of finished rows (same
        ``max_tokens``) that outlived ``num_generated``; the ``max_tokens`` bound while fewer than
        a handful did (a sequence longer than all its finished peers may run to its limit)."""
        window = self._by_max.get(int(max_tokens))
        if window is None:
            return float(budget.tokens_left(max_tokens, num_generated))
        estimate = window.estimates.get(num_generated)
        if estimate is None:  # the pool asks for every outstanding item at every lease: memoized
            estimate = window.estimates[num_generated] = self._estimate(window, num_generated, max_tokens)
        return estimate

    @staticmethod
    def _estimate(window: _LengthWindow, num_generated: int, max_tokens: int) -> float:
        bound = budget.tokens_left(max_tokens, num_generated)
        count, total = window.longer_than(num_generated)
        if count < _MIN_LENGTH_SAMPLES:
            return float(bound)
        return min(float(bound), total / count - num_generated)
