"""Greedy constrained rows from the chunked LM head: the grammar read with each chunk.

NOTE: a greedy step whose rows include constrained ones can take the chunked LM head
(``model/lm_head_topk.py``) like a plain greedy step, so it does not write and re-read the
[N, V] logits (at 64 rows of the demo's 152k vocabulary the whole GEMM made every constrained
run ~1.3x the unconstrained one, whose greedy steps took the chunked head). The kernel reads
each filled row's mask words with its chunk and takes the statistics over the allowed tokens
alone, skipping the blocks of 128 tokens the mask allows nothing of, so the row's chosen token
is the first maximum over its allowed tokens, as the mask step gives on the whole logits,
without -inf written into the chunk. A lazy row (``structured/lazy.py``) is not masked: its
``CANDIDATES`` largest logits come from the same pass and are offered to its grammar in order,
as ``bitmask.pick_lazily`` does on the whole logits; every other row keeps its first maximum
alone (``kept_candidates``). A row none of whose candidates is allowed (a miss) gets its mask
filled; ``structured/lazy.py`` then fills that row for a few steps. A miss mostly comes where
the grammar narrows at once: a bounded JSON string at its last character allows only the closing
quote. So a miss's mask allowing one token gives that token; one allowing at most
1 / ``GATHER_SHARE`` of the vocabulary takes its logits at those tokens alone (their LM head
rows); only a denser one has its whole logits computed again (one more pass over the LM head for
the step's dense misses together, as long as the whole LM head's GEMM for those rows).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from batchgen_data.engine.sample.batch import SamplingBatch
from batchgen_data.engine.sample.bitmask import allowed_tokens, apply_token_bitmask
from batchgen_data.engine.sample.kernels import first_argmax
from batchgen_data.model.native.kernels import LogitTopK

# A lazy row's candidates from the chunked head: more than ``bitmask.LAZY_CANDIDATES`` because a
# miss here costs another pass over the LM head, where on the whole logits it costs a mask fill;
# the pass keeps them at little cost. A row whose last mask allowed 1/16 of the vocabulary (the
# least that goes lazy) misses 1.6% of the time for tokens drawn at random, (15/16)^64;
# ``[a-z]{400}``'s 11%, 0.06%.
CANDIDATES = 64
# A lazy row whose last mask allowed at least half the vocabulary (inside a JSON string: 86-97%
# of the demo's) keeps 16: for tokens drawn at random it misses 1 time in 65,000, and the top 64
# cost the stream 0.8-1.4 ms a step more than the top 16 for 64 rows (``benchmarks/lm_head_kernel.py``,
# random logits, Xeon).
DENSE_SHARE, DENSE_CANDIDATES = 0.5, 16
# A miss whose mask allows at most V / 16 tokens takes its logits at those alone: gathering their
# LM head rows costs at most a sixteenth of the pass over the whole head, less than the timing
# noise of a step.
GATHER_SHARE = 16


class MissLogits(Protocol):
    """The logits of rows the statistics do not settle (``model.lm_head_topk.HeadRows``)."""

    vocab: int

    def whole(self, rows: list[int]) -> torch.Tensor: ...

    def at(self, row: int, tokens: torch.Tensor) -> torch.Tensor: ...


def filled_masks(batch: SamplingBatch) -> tuple[np.ndarray, np.ndarray]:
    """(logits rows [r] int64, words [r, W] int32) of the constrained rows whose masks are
    filled: every mask row but the lazy ones (theirs are not written yet)."""
    if batch.bitmask_lazy is None:
        return np.asarray(batch.bitmask_rows, dtype=np.int64), batch.token_bitmask
    lazy = set(batch.bitmask_lazy.mask_rows)
    keep = [i for i in range(len(batch.bitmask_rows)) if i not in lazy]
    rows = np.asarray([batch.bitmask_rows[i] for i in keep], dtype=np.int64)
    return rows, batch.token_bitmask[keep]


def kept_candidates(batch: SamplingBatch, num_rows: int) -> np.ndarray | None:
    """[num_rows] int64: how many of the largest logits each row needs from the chunked head,
    ``CANDIDATES`` for a lazy row (``DENSE_CANDIDATES`` where its last mask was dense) and 1 (its
    first maximum) for any other; None where no row is lazy (then the head keeps 1 for every row)."""
    lazy = batch.bitmask_lazy
    if lazy is None:
        return None
    keep = np.ones(num_rows, dtype=np.int64)
    for mask_row, request in zip(lazy.mask_rows, lazy.requests):
        dense = request.allowed_share >= DENSE_SHARE
        keep[batch.bitmask_rows[mask_row]] = min(CANDIDATES, DENSE_CANDIDATES) if dense else CANDIDATES
    return keep


def grammar_tokens(top: LogitTopK, batch: SamplingBatch, head: MissLogits) -> torch.Tensor:
    """[N] int64: each row's greedy token under its grammar, from ``top`` (the chunked head's
    statistics, the filled masks applied); ``head`` gives the logits of the lazy rows whose
    candidates the grammar all rejects (see module NOTE)."""
    tokens = top.chosen.clone()
    lazy = batch.bitmask_lazy
    if lazy is None:
        return tokens
    dense: list[int] = []  # mask rows of misses whose whole logits are needed
    rows = [batch.bitmask_rows[mask_row] for mask_row in lazy.mask_rows]
    for i, (mask_row, row, candidates) in enumerate(zip(lazy.mask_rows, rows, top.top_ids[rows].tolist())):
        if candidates[-1] < 0:  # -1: past what the row kept
            candidates = candidates[: candidates.index(-1)]
        token = lazy.first_allowed(i, candidates)
        if token is None:
            lazy.fill(i, batch.token_bitmask)
            token = _sparse_pick(head, row, batch.token_bitmask[mask_row])
        if token is None:
            dense.append(mask_row)
        else:
            tokens[row] = token
    if dense:
        dense_rows = [batch.bitmask_rows[m] for m in dense]
        logits = head.whole(dense_rows)
        local = list(range(len(dense_rows)))
        picks = apply_token_bitmask(logits, batch.token_bitmask[dense], local, [True] * len(dense_rows))
        chosen = first_argmax(logits)  # rows the mask step did not pick are masked in place
        if picks is not None:
            chosen[picks.rows] = picks.tokens
        tokens[torch.tensor(dense_rows)] = chosen
    return tokens


def _sparse_pick(head: MissLogits, row: int, words: np.ndarray) -> int | None:
    """The first maximum of ``row``'s logits over the tokens its mask ``words`` allows, from
    their logits alone; None where the mask allows none or more than V / ``GATHER_SHARE``."""
    allowed = allowed_tokens(words, head.vocab)
    if len(allowed) == 1:
        return int(allowed[0])
    if not 0 < len(allowed) <= head.vocab // GATHER_SHARE:
        return None
    ids = torch.from_numpy(allowed)
    return int(ids[first_argmax(head.at(row, ids)[None])[0]])
