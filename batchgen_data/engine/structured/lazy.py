"""Greedy constrained rows whose mask is filled only if their largest logits need it. No torch.

NOTE: a greedy row's token under its grammar is the first maximum of its logits over the allowed
tokens: the first allowed token in the order (logit down, token id up). So the sampler offers the
row's largest logits in that order to the grammar library, one token at a time
(``LazyGrammarRows.first_allowed``), and the first one allowed is the token; only where none of
them is (``sample/bitmask.LAZY_CANDIDATES`` from the whole logits,
``sample/grammar_topk.CANDIDATES`` from the chunked LM head) is the row's mask filled. The check is the library's
own verdict on the token (``validate_tokens``; an end-of-sequence token where the grammar
accepts), except where the grammar forces its next bytes: there the library's mask is the forced
token alone, not every token its verdict takes, so such a row is always filled
(``compute_ff_tokens``). ``tests/engine/test_lazy_grammar_rows.py`` checks both against the
filled masks, state by state, and that tokens equal those of rows that were always filled.

A row is left unfilled only where a pick is likely to succeed: its last filled mask allowed at
least 1 / ``LAZY_MIN_SHARE`` of the vocabulary (inside a JSON string, a counted class like
``[a-z]{400}``), or its last lazy pick succeeded. A miss fills the row (the candidates and the
checks were extra) and backs off: the row is filled for 1, 2, 4 ... 32 steps before it is tried
again. Inside a bounded JSON string the library walks every token longer than the characters
left for a fill, where a check reads one token (``benchmarks/structured.py`` reports the fill
per step and the share of lazy picks).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from batchgen_data.engine.structured.request import StructuredRequest

MAX_BACKOFF = 32  # steps a row is filled after a miss, at most
# A row goes lazy after a filled mask that allowed at least 1/16 of the vocabulary: its 16
# largest logits (``sample/bitmask.LAZY_CANDIDATES``) then hold an allowed token unless the model
# keeps away from what the grammar allows (for tokens drawn at random, 1 - (15/16)^16 = 64% of
# the time; 85% for ``[a-z]{400}``, whose masks allow 11% of the demo's vocabulary).
LAZY_MIN_SHARE = 16


class MaskOwner(Protocol):
    """What the rows need of the manager that left them unfilled (``StructuredOutputManager``)."""

    eos_token_ids: frozenset[int]
    mask_s: float
    lazy_picks: int

    def fill_row(self, request: StructuredRequest, mask: np.ndarray, row: int) -> None: ...


@dataclass(slots=True, eq=False)
class LazyGrammarRows:
    """The unfilled rows of one step's grammar bitmask (see module NOTE): ``mask_rows[i]`` is
    the bitmask row of ``requests[i]``."""

    mask_rows: list[int]
    requests: list[StructuredRequest]
    manager: MaskOwner

    def first_allowed(self, i: int, tokens: list[int]) -> int | None:
        """The first of ``tokens`` that row ``i``'s mask would allow, told without the mask;
        None where none is, or where it cannot be told this way (the row must then be filled)."""
        start = time.perf_counter()
        request = self.requests[i]
        matcher = request.matcher
        found = None
        if not matcher.compute_ff_tokens():
            eos = self.manager.eos_token_ids
            for token in tokens:
                ok = matcher.is_accepting() if token in eos else matcher.validate_tokens([token]) == 1
                if ok:
                    found = token
                    break
        if found is not None:
            request.lazy_backoff = 0
            self.manager.lazy_picks += 1
        else:
            request.lazy_backoff = min(MAX_BACKOFF, 2 * request.lazy_backoff or 1)
            request.lazy_wait = request.lazy_backoff
            request.lazy = False
        self.manager.mask_s += time.perf_counter() - start
        return found

    def fill(self, i: int, bitmask: np.ndarray) -> None:
        """Fill row ``i``'s mask into its row of ``bitmask`` (the step's bitmask, in place)."""
        self.manager.fill_row(self.requests[i], bitmask, self.mask_rows[i])
