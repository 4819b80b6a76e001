"""What the scheduler hands the model runner for one forward (``SchedulerOutput``, built by
``combine``) and its counters.
No torch: plain lists of records and ints.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batchgen_data.engine.core.sequence import Sequence


@dataclass(slots=True)
class SchedulerOutput:
    """One forward's work, in batch order: plain lists of sequences and ints (and, for swap-in,
    the host KV to restore)."""

    seqs: list[Sequence]
    query_lens: list[int]
    # The sequence's pending tokens all run now: sample its next token (a pooling sequence is
    # pooled instead: its prompt is complete).
    samples: list[bool]
    # Save these pages' KV to host first (the runner returns it in ``ModelRunnerOutput.host_kv``)...
    swap_out: list[tuple[Sequence, list[int]]] = field(default_factory=list)
    # ...then restore host KV into the sequences' new pages. ``None``: the sequence was swapped
    # out earlier in this same step; its KV is what the runner just read.
    swap_in: list[tuple[Sequence, Any]] = field(default_factory=list)
    # Structured outputs: positions, among the sampling sequences, of the constrained ones, and
    # their bitmasks of allowed tokens (numpy [len(grammar_rows), ceil(V / 32)] int32).
    grammar_rows: list[int] = field(default_factory=list)
    grammar_bitmask: Any = None
    grammar_lazy: Any = None  # ``structured.lazy.LazyGrammarRows``: mask rows left unfilled, or None
    # Taken out while scheduling (a grammar that failed): they finish as errors in ``update``.
    finished: list[Sequence] = field(default_factory=list)
    # Speculative decoding with an MTP layer: the most draft tokens the runner makes for each
    # sampling row's next step (0: the layer only keeps its KV up to date).
    num_mtp_drafts: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def sampling_seqs(self) -> list[Sequence]:
        """The sequences that sample a token in this forward, in batch order (the grammar rows
        and the runner's sampled tokens index this list)."""
        return [seq for seq, last in zip(self.seqs, self.samples) if last and not seq.is_pooling]

    @property
    def decoding(self) -> list[bool]:
        """Per sequence: it decodes (its pending token, plus a draft if it has one), rather
        than running a prefill chunk."""
        return [q == 1 + len(seq.draft_token_ids) for seq, q in zip(self.seqs, self.query_lens)]

    @property
    def is_decode_step(self) -> bool:
        """Every sequence decodes and samples, and no KV moves: a step whose time the
        speculative policy learns from."""
        return bool(self.seqs) and all(self.samples) and all(self.decoding) and not self.swap_in and not self.swap_out

    @property
    def is_progress(self) -> bool:
        """Whether this step changes anything: a forward, a suspension or a finished sequence."""
        return bool(self.seqs or self.swap_out or self.finished)




@dataclass(slots=True)
class SchedulerStats:
    num_suspended: int = 0
    num_resumed_swap: int = 0
    num_resumed_recompute: int = 0
    num_recomputed_tokens: int = 0
    num_prefix_query_tokens: int = 0  # tokens of sequences admitted while caching is on
    num_prefix_hit_tokens: int = 0  # of which found in the prefix cache (not computed)


def combine(running: list[Sequence], budget: int, chunked_prefill: bool = True
            ) -> tuple[list[Sequence], list[int], list[bool]]:
    """COMBINE the running set's pending work into one forward of at most ``budget`` tokens:
    decoders first (one token each), then prefill chunks in admission order. Returns the
    sequences, their query lengths, and whether each samples (all its pending tokens run).
    Without ``chunked_prefill`` (vLLM's ``enable_chunked_prefill=False``) a prompt runs whole or
    waits, and the prompts admitted after it wait with it (first come, first served). A decoder
    with a draft (speculative decoding) runs its pending token and the draft, and samples at
    each of those positions."""
    seqs, query_lens, samples = [], [], []
    for seq in running:
        if seq.num_pending_tokens == 1:  # a decoder: its pending token and this step's draft
            query = 1 + len(seq.draft_token_ids)
            seqs.append(seq), query_lens.append(query), samples.append(True)
            budget -= query
    for seq in running:
        pending = seq.num_pending_tokens
        if pending > 1 and budget > 0:
            if not chunked_prefill and pending > budget:
                break
            chunk = min(pending, budget)
            seqs.append(seq), query_lens.append(chunk), samples.append(chunk == pending)
            budget -= chunk
    return seqs, query_lens, samples
