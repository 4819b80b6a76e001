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

    @property
    def is_ready(self) -> bool:
        return self.matcher is not None
