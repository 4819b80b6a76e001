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
    followed its earliest occurrence are the draft (``lookup``, through the row's ``NgramIndex``)."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seq: Sequence, k: int) -> list[int]:
        return row_index(seq, self.min_n, self.max_n).lookup(seq.prompt_token_ids + seq.output_token_ids, k)[1]


class NgramIndex:
    """The earliest start of every n-gram (``min_n <= n <= max_n``) of a row's tokens, extended
    as tokens are appended: ``lookup`` in O(max_n) instead of a scan of the row (0.3 ms for a
    4,000-token prompt in Python, every step). Kept on the sequence while it drafts
    (``Sequence.draft_index``): ~(max_n - min_n + 1) entries per token."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.first: dict[tuple[int, ...], int] = {}
        self.size = 0

    def lookup(self, tokens: list[int], k: int) -> tuple[int, list[int]]:
        """``longest_lookup(tokens, min_n, max_n, k)``; ``tokens`` extend the ones seen before."""
        first, size = self.first, len(tokens)
        for end in range(self.size, size):  # the n-grams ending at each new token
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                first.setdefault(tuple(tokens[end - n + 1 : end + 1]), end - n + 1)
        self.size = size
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            start = first.get(tuple(tokens[size - n:]))
            if start is not None and start < size - n:  # an occurrence before the suffix itself
                return n, tokens[start + n : start + n + k]
        return 0, []


def row_index(seq: Sequence, min_n: int, max_n: int) -> NgramIndex:
    index = seq.draft_index
    if index is None or (index.min_n, index.max_n) != (min_n, max_n):
        index = seq.draft_index = NgramIndex(min_n, max_n)
    return index


def lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The ``k`` tokens after the earliest earlier occurrence of the longest suffix n-gram
    (``min_n <= n <= max_n``) of ``tokens``; [] when no suffix of ``min_n`` tokens recurs."""
    return longest_lookup(tokens, min_n, max_n, k)[1]


def longest_lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> tuple[int, list[int]]:
    """``lookup``, with the length of the n-gram matched (0: none)."""
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = tokens[size - n:]
        first = suffix[0]
        for start in range(0, size - n):  # an occurrence that ends before the suffix itself starts its draft
            if tokens[start] == first and tokens[start:start + n] == suffix:
                return n, tokens[start + n : start + n + k]
    return 0, []


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


class SuffixProposer:
    """Suffix decoding (vLLM's ``suffix`` method, after SuffixDecoding, arXiv 2411.04975): the
    job's finished outputs, and the row's own prompt and output, predict its next tokens.

    The job's last ``max_cached`` outputs are kept as continuation counts of every context of
    1..``max_depth`` tokens, keyed by the context's hash (a collision can only cost a rejected
    draft, never a token). A draft extends the row's tokens one token at a time with the most
    frequent continuation of their longest known suffix, while that token's share of the
    continuations is at least ``min_token_prob``; where the row's own prompt lookup
    (``lookup``) matches a longer suffix, its tokens are the draft instead. Outputs of a job that
    share a structure (a JSON skeleton, a template) are drafted after a few rows. Memory: at
    most ``max_cached * output length * max_depth`` counts (the defaults: 256 outputs, depth 8).
    """

    def __init__(self, max_depth: int = 8, max_cached: int = 256, min_token_prob: float = 0.1,
                 prompt_lookup_min: int = 1, prompt_lookup_max: int = 4):
        self.max_depth, self.max_cached, self.min_token_prob = max_depth, max_cached, min_token_prob
        self.prompt_lookup_min, self.prompt_lookup_max = prompt_lookup_min, prompt_lookup_max
        self._next: dict[int, dict[int, int]] = {}
        self._outputs: list[list[int]] = []  # the cached outputs, oldest first

    def observe(self, seq: Sequence) -> None:
        """Learn a finished row's output (past ``max_cached``, the older half is forgotten)."""
        output = list(seq.output_token_ids)
        if len(output) < 2:
            return
        self._outputs.append(output)
        if len(self._outputs) > self.max_cached:
            self._outputs = self._outputs[len(self._outputs) // 2:]
            self._next = {}
            for kept in self._outputs:
                self._count(kept)
        else:
            self._count(output)

    def propose(self, seq: Sequence, k: int) -> list[int]:
        tokens = seq.prompt_token_ids + seq.output_token_ids
        context = tokens[-self.max_depth:]
        draft: list[int] = []
        token, matched = self._continue(context)
        while token is not None and len(draft) < k:
            draft.append(token)
            context = (context + [token])[-self.max_depth:]
            token, _ = self._continue(context)
        own_length, own = row_index(seq, self.prompt_lookup_min, self.prompt_lookup_max).lookup(tokens, k)
        return own if own and own_length > matched else draft

    def _continue(self, context: list[int]) -> tuple[int | None, int]:
        """The most frequent next token after the longest known suffix of ``context`` (None if
        its share is below ``min_token_prob``) and that suffix's length."""
        for depth in range(min(len(context), self.max_depth), 0, -1):
            counts = self._next.get(hash(tuple(context[-depth:])))
            if counts:
                token, count = max(counts.items(), key=lambda item: item[1])
                return (token if count >= self.min_token_prob * sum(counts.values()) else None), depth
        return None, 0

    def _count(self, output: list[int]) -> None:
        for end in range(1, len(output)):
            following = output[end]
            for depth in range(1, min(end, self.max_depth) + 1):
                counts = self._next.setdefault(hash(tuple(output[end - depth:end])), {})
                counts[following] = counts.get(following, 0) + 1


class MTPProposer:
    """The checkpoint's Multi-Token-Prediction layer: the drafts the runner made for the row in
    the step before (``engine/worker/mtp_drafts.py``), if its tokens are still the ones they
    follow."""

    def propose(self, seq: Sequence, k: int) -> list[int]:
        made = seq.mtp_draft
        if made is None or made[0] != seq.num_tokens:
            return []
        return made[1][:k]
