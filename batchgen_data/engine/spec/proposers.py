"""Proposers: a row's likely next tokens, from what the engine already has. No torch.

A proposer answers ``propose(seq, k)`` with at most ``k`` tokens (fewer, or none, when it has
no guess). Nothing it proposes can change a row's output: the drafts are checked by the model
(``drafter.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from batchgen_data.engine.core.sequence import Sequence


class Proposer(Protocol):
    def propose(self, seq: Sequence, k: int) -> list[int]: ...


class NgramProposer:
    """Prompt lookup (vLLM's ``ngram`` method): the longest suffix of the row's tokens, between
    ``min_n`` and ``max_n`` long, that occurred earlier in its prompt or output; the tokens that
    followed its earliest occurrence are the draft."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seq: Sequence, k: int) -> list[int]:
        tokens = seq.prompt_token_ids + seq.output_token_ids
        return lookup(tokens, self.min_n, self.max_n, k)


def lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The ``k`` tokens after the earliest earlier occurrence of the longest suffix n-gram
    (``min_n <= n <= max_n``) of ``tokens``; [] when no suffix of ``min_n`` tokens recurs."""
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = tokens[size - n:]
        first = suffix[0]
        for start in range(0, size - n):  # an occurrence that ends before the suffix itself starts its draft
            if tokens[start] == first and tokens[start:start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


class TableProposer:
    """For benchmarks and tests: each prompt's known output (a plain run's tokens), proposed
    as they are (``wrong=False``: an oracle, every draft accepted up to the row's end) or each
    token shifted by one (``wrong=True``: every draft rejected)."""

    def __init__(self, outputs: dict[tuple[int, ...], list[int]], vocab_size: int, wrong: bool = False):
        self.outputs, self.vocab_size, self.wrong = outputs, vocab_size, wrong

    def propose(self, seq: Sequence, k: int) -> list[int]:
        known = self.outputs.get(tuple(seq.prompt_token_ids), [])
        done = seq.num_generated
        draft = known[done : done + k]
        if self.wrong:
            draft = [(t + 1) % self.vocab_size for t in draft] or [0] * k
        return draft
