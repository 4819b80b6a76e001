"""One sequence's grammar state: ``StructuredRequest``. No torch, no grammar library."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True, eq=False)
class StructuredRequest:
    """One sequence's grammar: compiling (``future`` of a ``CompiledGrammar``), then a matcher,
    or an error."""

    future: Future
    matcher: Any = None  # llguidance.LLMatcher once ready
    error: str | None = None
    # Lazy greedy picks (``lazy.py``): whether the next step may leave this row's mask unfilled,
    # the steps it is filled before that may be tried again, and the current back-off; the
    # share of the vocabulary its last filled mask allowed (estimated from every 8th word).
    lazy: bool = False
    lazy_wait: int = 0
    lazy_backoff: int = 0
    allowed_share: float = 0.0

    @property
    def is_ready(self) -> bool:
        return self.matcher is not None
