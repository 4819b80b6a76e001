"""The grammar lifecycle of a scheduler's constrained sequences. No torch.

NOTE: a sequence with structured outputs is ``WAITING_FOR_GRAMMAR`` from ``attach`` until its
grammar has compiled (``poll``): then ``WAITING`` (``SUSPENDED`` if it was imported
mid-generation, its matcher replayed over its tokens), or, if the grammar failed, out of the
scheduler as an error row. While it runs, each step fills the bitmasks of the constrained rows
that sample and advances their matchers by the sampled tokens. The compile itself runs on the
grammar manager's thread; ``wait_any`` blocks only when nothing else can run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from batchgen_data.engine.core.sequence import SequenceStatus

if TYPE_CHECKING:
    from batchgen_data.engine.core.sequence import Sequence
    from batchgen_data.engine.structured.manager import StructuredOutputManager

# How long one wait for a grammar compile lasts before the scheduler looks at its queues again.
GRAMMAR_WAIT_S = 1.0
# How long a step that would only start sequences (nothing decodes yet) waits for the grammars
# still compiling, so their rows start in the same prefill. A job whose rows each have their own
# schema otherwise prefills the few whose grammar compiled first, and the rest a step later: one
# more step, and the late rows then decode one step behind to the end (a last step for them
# alone). A JSON schema compiles in about a millisecond (``benchmarks/structured.py`` reports
# it); a grammar slower than the bound is not waited for.
GRAMMAR_JOIN_S = 0.1


class GrammarGate:
    """Constrained sequences' grammars for one scheduler (``structured`` None: none allowed)."""

    def __init__(self, structured: StructuredOutputManager | None):
        self.structured = structured
        self.compiling: list[Sequence] = []

    def attach(self, seq: Sequence) -> None:
        """Start compiling a constrained sequence's grammar; it waits for it from now on."""
        if seq.is_pooling or seq.params.structured_outputs is None:
            return
        if self.structured is None:
            raise RuntimeError("a sequence with structured_outputs reached a scheduler without a grammar manager")
        self.structured.attach(seq)
        seq.transition(SequenceStatus.WAITING_FOR_GRAMMAR)
        self.compiling.append(seq)

    def poll(self, suspended: list[Sequence]) -> list[Sequence]:
        """Let compiled sequences go on (``suspended`` ones resume as such); return those whose
        grammar failed, still in their queues, for the scheduler to take out."""
        failed = []
        for seq in list(self.compiling):
            if self.structured.poll(seq):
                self.compiling.remove(seq)
                seq.transition(SequenceStatus.SUSPENDED if seq in suspended else SequenceStatus.WAITING)
            elif seq.structured.error is not None:
                failed.append(seq)
        return failed

    def wait_any(self) -> None:
        """Block until a compiling grammar is done, or ``GRAMMAR_WAIT_S``."""
        self._wait(GRAMMAR_WAIT_S, every=False)

    def wait_all(self) -> None:
        """Block until every compiling grammar is done, or ``GRAMMAR_JOIN_S``."""
        self._wait(GRAMMAR_JOIN_S, every=True)

    def _wait(self, timeout_s: float, every: bool) -> None:
        from batchgen_data.engine.structured.manager import StructuredOutputManager

        StructuredOutputManager.wait_compiled(self.compiling, timeout_s, every)

    def discard(self, seq: Sequence) -> None:
        if seq in self.compiling:
            self.compiling.remove(seq)

    def bitmask(self, sampling: list[Sequence]) -> tuple[list[int], Any, Any]:
        """Positions among ``sampling`` of the constrained rows, their bitmasks (a row with a
        speculative draft of k tokens has k + 1 consecutive mask rows) and the mask rows left
        for a lazy greedy pick (``structured/lazy.py``), or None."""
        rows = [row for row, seq in enumerate(sampling) if seq.structured is not None]
        if not rows or self.structured is None:
            return [], None, None
        return rows, *self.structured.bitmask([sampling[row] for row in rows])

    def valid_draft(self, seq: Sequence, draft: list[int]) -> list[int]:
        """A constrained sequence's draft cut where its grammar would reject it or complete."""
        return self.structured.valid_draft(seq, draft)

    def advance(self, seq: Sequence, token: int) -> tuple[str | None, bool]:
        """Advance a constrained sequence's matcher by its sampled token: (an error if the
        grammar rejects it, whether the grammar is now complete)."""
        error = self.structured.accept(seq, token)
        return error, error is None and self.structured.is_terminated(seq)
