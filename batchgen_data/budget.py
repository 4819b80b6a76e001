"""A sequence's generation budget: the tokens it may still generate. One rule, read by the
scheduler (``Sequence``), the progress it publishes (``RequestProgress``, ``SeqProgress``),
request handles, expert-parallel ranks, the speculative drafter, the MIGRATE planner and the
cross-actor rebalancer. Plain arithmetic, no torch."""

from __future__ import annotations


def tokens_left(max_tokens: int, num_generated: int) -> int:
    """Tokens a sequence may still generate: what its ``max_tokens`` leaves (never below 0).

    Example:
        >>> tokens_left(16, 10), tokens_left(16, 16)
        (6, 0)
    """
    return max(0, max_tokens - num_generated)
