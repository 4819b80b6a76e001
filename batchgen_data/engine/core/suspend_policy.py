"""Which running sequence yields when KV pages run out, and which suspended one comes back first
(``EngineConfig.suspend_policy``). No torch.

``"most_progress"`` keeps the sequences nearest completion running: the least advanced yields
first (the newest among equals) and the most advanced resumes first. ``"shortest_first"`` yields
the sequence holding the fewest tokens and resumes the shortest first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchgen_data.engine.core.sequence import Sequence


def pick_victim(running: list[Sequence], policy: str) -> Sequence:
    if policy == "most_progress":
        return min(reversed(running), key=lambda s: s.num_generated)
    return min(reversed(running), key=lambda s: s.num_tokens)  # shortest_first


def resume_order(policy: str) -> Callable[[Sequence], int]:
    """Sort key of suspended sequences: the ones that would be kept running come back first."""
    if policy == "most_progress":
        return lambda s: -s.num_generated
    return lambda s: s.num_tokens
