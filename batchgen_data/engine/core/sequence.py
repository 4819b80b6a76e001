"""The sequence coroutine: one prompt's execution, its state and its lifecycle.

A sequence yields to the scheduler at module boundaries inside a forward (attention micro-batch ->
combined MoE batch) and between forwards; between forwards it can also be suspended (its KV moved
to host or dropped) and resumed, or exported to another engine. Its result does not depend on
any of that: sampling randomness is keyed by (seed, tokens generated so far).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from batchgen_data.budget import tokens_left
from batchgen_data.engine.pooling_params import PoolingParams
from batchgen_data.engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # the scheduler imports this module and stays torch-free
    import torch

    from batchgen_data.engine.sample.logprobs import TokenLogprobs
    from batchgen_data.engine.structured.request import StructuredRequest


class SequenceStatus(enum.Enum):
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"  # queued while its structured-output grammar compiles
    WAITING = "waiting"  # in the waiting pool, never run
    RUNNING = "running"  # holds KV pages in the pool; scheduled every step
    SUSPENDED = "suspended"  # yielded for memory: KV on host (swapped) or dropped (recompute)
    FINISHED = "finished"  # stop / length / error (a pooling request: pooled, "stop"); KV freed
    EXPORTED = "exported"  # migrated out of this engine (its state lives elsewhere now)


# The lifecycle, as data. Every status change goes through ``Sequence.transition``, and only
# the scheduler (or, for a sequence that never reached one, the engine) makes it:
#   WAITING -> WAITING_FOR_GRAMMAR   added (or imported) with structured outputs: compiling
#   WAITING_FOR_GRAMMAR -> WAITING   its grammar is ready (SUSPENDED: it had generated tokens)
#   WAITING_FOR_GRAMMAR -> FINISHED  its grammar failed: an error row, in the step that saw it
#   WAITING -> RUNNING      admitted into the running set
#   WAITING -> SUSPENDED    imported mid-generation (MIGRATE in): it resumes like a suspended one
#   RUNNING -> SUSPENDED    yielded to host when KV pages ran out
#   SUSPENDED -> RUNNING    resumed by swap-in or recompute
#   * -> FINISHED           stop, length, or error (an invalid request, an abort)
#   * -> EXPORTED           MIGRATE out (it continues in another engine)
TRANSITIONS: dict[SequenceStatus, frozenset[SequenceStatus]] = {
    SequenceStatus.WAITING_FOR_GRAMMAR: frozenset(
        {SequenceStatus.WAITING, SequenceStatus.SUSPENDED, SequenceStatus.FINISHED, SequenceStatus.EXPORTED}
    ),
    SequenceStatus.WAITING: frozenset(
        {SequenceStatus.WAITING_FOR_GRAMMAR, SequenceStatus.RUNNING, SequenceStatus.SUSPENDED,
         SequenceStatus.FINISHED, SequenceStatus.EXPORTED}
    ),
    SequenceStatus.RUNNING: frozenset(
        {SequenceStatus.SUSPENDED, SequenceStatus.FINISHED, SequenceStatus.EXPORTED}
    ),
    SequenceStatus.SUSPENDED: frozenset(
        {SequenceStatus.RUNNING, SequenceStatus.FINISHED, SequenceStatus.EXPORTED}
    ),
    SequenceStatus.FINISHED: frozenset(),
    SequenceStatus.EXPORTED: frozenset(),
}
# The statuses a MIGRATE can take a sequence out of (between steps).
EXPORTABLE = frozenset(s for s, targets in TRANSITIONS.items() if SequenceStatus.EXPORTED in targets)


@dataclass(slots=True)
class SequenceState:
    """A sequence's portable form (MIGRATE): enough to continue it in another engine.

    ``kv`` is optional: without it the importing engine recomputes the KV from the tokens.
    """

    request_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams | PoolingParams
    seed: int
    kv: torch.Tensor | None = None  # [num_tokens_in_kv, values per token] (``KVCache.read_tokens``)
    logprobs: list[TokenLogprobs] | None = None  # one per output token, when asked
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # the prompt entries computed so far


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams  # PoolingParams: prefill-only, pooled when its prompt is computed
    seed: int
    arrival_s: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    host_kv: torch.Tensor | None = None  # KV saved while SUSPENDED by swapping (the scheduler's)
    finish_reason: str | None = None
    error: str | None = None
    stop_text_len: int | None = None  # where a stop string cut the text
    first_token_s: float | None = None
    finished_s: float | None = None
    num_suspensions: int = 0
    # KV blocks (the KV manager's): names of the sequence's full blocks so far (tokens never
    # change, so they survive suspension), how many of its current blocks are named in the
    # prefix cache; the prompt tokens its first admission found cached, admissions it waited
    # for a sibling computing a shared prefix (the scheduler's).
    block_names: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    num_cached_tokens: int | None = None
    num_deferrals: int = 0
    # Structured outputs (the scheduler's): the grammar compiling, then its matcher; None for an
    # unconstrained sequence. It is not part of the portable state: an importing engine rebuilds
    # it by replaying the output tokens.
    structured: StructuredRequest | None = None
    # Logprobs (the scheduler's): one entry per output token when ``params.logprobs`` is set;
    # the prompt's entries computed so far when ``params.prompt_logprobs`` is (entry 0 is None).
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # A pooling request's result (the scheduler's, from the runner's pooler): the embedding or
    # the class probabilities (vLLM's ``PoolingOutput.data``).
    pooled_data: list[float] | None = None
    # Speculative decoding (the scheduler's drafter, ``engine/spec/drafter.py``): this step's
    # draft, checked in the same forward as the pending token and cleared when the step's
    # tokens are accepted (never present between steps); the row's acceptance record.
    draft_token_ids: list[int] = field(default_factory=list)
    draft_acceptance: Any = None
    draft_index: Any = None  # the n-gram proposers' index of its tokens (``NgramIndex``)
    # The MTP layer's drafts for the next step, made by the runner in this one: (the row's
    # token count they follow, the tokens), or None.
    mtp_draft: tuple[int, list[int]] | None = None

    @classmethod
    def from_state(cls, state: SequenceState, request_id: int, now_s: float) -> Sequence:
        """The record of a sequence continued from its portable state (MIGRATE in)."""
        seq = cls(request_id, list(state.prompt_token_ids), state.params, state.seed, arrival_s=now_s)
        seq.output_token_ids = list(state.output_token_ids)
        seq.logprobs = None if state.logprobs is None else list(state.logprobs)
        seq.prompt_logprobs = None if state.prompt_logprobs is None else list(state.prompt_logprobs)
        return seq

    def append_token(self, token: int, logprobs: TokenLogprobs | None, now_s: float) -> None:
        """A sampled token (and its logprobs, kept when the request asked for them)."""
        self.output_token_ids.append(token)
        if self.params.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.append(logprobs)
        if self.first_token_s is None:
            self.first_token_s = now_s

    def transition(self, new: SequenceStatus) -> None:
        if new not in TRANSITIONS[self.status]:
            raise RuntimeError(f"sequence {self.request_id}: illegal transition {self.status.name} -> {new.name}")
        self.status = new

    @property
    def is_pooling(self) -> bool:
        """A prefill-only request (embed, classify): it finishes, pooled, when its prompt is
        computed, and never samples."""
        return isinstance(self.params, PoolingParams)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prompt positions each need their logprobs (so none may come from the cache)."""
        return not self.is_pooling and self.params.prompt_logprobs is not None

    @property
    def computes_whole_prompt(self) -> bool:
        """None of its prompt may come from the prefix cache: its prompt logprobs need every
        position, and a pooled state must not depend on which prefix was cached (a cached prefix
        changes the shapes the last position's state is computed in, and its last bits)."""
        if self.is_pooling:
            return self.params.skip_reading_prefix_cache is not False
        return self.wants_prompt_logprobs

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_left(self) -> int:
        """Tokens the sequence may still generate (its ``max_tokens`` budget left)."""
        return tokens_left(self.params.max_tokens, self.num_generated)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens not yet in KV: the rest of the prompt (prefill) or the last sampled token."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def token_ids(self) -> list[int]:
        """Prompt then output tokens (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_range(self, start: int, end: int) -> list[int]:
        """Tokens ``start:end`` of prompt, output and, past them, this step's draft."""
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        if end > self.num_tokens and self.draft_token_ids:
            return self.token_ids_range(start, self.num_tokens) + self.draft_token_ids[: end - self.num_tokens]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : end - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt_len]

    def finish(self, reason: str, now_s: float, error: str | None = None) -> None:
        self.transition(SequenceStatus.FINISHED)
        self.finish_reason, self.error, self.finished_s = reason, error, now_s
        self.host_kv = None
        self.structured = None
        self.draft_index = None
        self.mtp_draft = None

    def export_state(self, kv: torch.Tensor | None = None) -> SequenceState:
        return SequenceState(
            request_id=self.request_id,
            prompt_token_ids=list(self.prompt_token_ids),
            output_token_ids=list(self.output_token_ids),
            params=self.params,
            seed=self.seed,
            kv=kv,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            prompt_logprobs=None if self.prompt_logprobs is None else list(self.prompt_logprobs),
        )
