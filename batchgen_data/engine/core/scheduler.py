"""The inter-forward scheduler: select, combine, manage pages (paper Algorithm 2). No torch.

NOTE: one step of ``schedule()``:
  1. Extend. Every running sequence gets its pending work for this forward: decoders one token,
     prefilling sequences (new, or resumed by recompute) a chunk of what is left of the token
     budget. A sequence that crosses a KV page boundary gets a new page; when none is free,
     running sequences YIELD to host (suspend) in ``suspend_policy`` order until one is.
  2. Refill. When the running set has fallen below ``refill_threshold * max_num_seqs`` (or is
     empty, or nothing is suspended and all waiting work fits its free slots), suspended
     sequences resume first, then waiting ones are admitted, while their pages fit (keeping one
     page of headroom per running sequence) and the set is below max_num_seqs. With prefix
     caching, a sequence starts after the longest prefix of its blocks already cached (at
     least its last token is computed), and waiting ones are admitted in prefix order: within
     a window at the queue's head, the longest cached prefix first (ties in arrival order), and
     one whose next block a running sequence is computing right now waits for it (at most
     ``_MAX_DEFERRALS`` admissions), so siblings never compute a shared prefix twice.
     A sequence with structured outputs is admitted only once its grammar has compiled (it
     waits in its queue meanwhile; the step only blocks on a compile when nothing can run).
  3. Emit. The running sequences with work this step, in order, and their query lengths, are
     COMBINED into one forward (the model runner splits attention into micro-batches); the
     constrained ones that sample get their grammar's bitmask of allowed tokens.
``update()`` then applies the runner's ``ModelRunnerOutput``: keeps swapped-out KV, names the
blocks whose KV is now complete in the prefix cache, appends sampled tokens (advancing the
grammars), applies the stop rules and frees finished sequences.
Per-sequence Python work here is O(1) per step; page work happens once per page of tokens.

The scheduler is the only writer of its state: its queues, the sequences' statuses, block ids
and host KV, and the host-byte counter change only through its methods (``add``,
``schedule``, ``update``, ``export``, ``import_state``, ``abort``); every status change goes
through ``Sequence.transition``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from batchgen_data.config import EngineConfig
from batchgen_data.engine.core.block_manager import BlockManager, block_hashes
from batchgen_data.engine.core.runner_output import ModelRunnerOutput
from batchgen_data.engine.core.sequence import Sequence, SequenceState, SequenceStatus
from batchgen_data.engine.structured.manager import StructuredOutputManager


@dataclass(slots=True)
class SchedulerOutput:
    """One forward's work, in batch order: plain lists of sequences and ints (and, for swap-in,
    the host KV to restore)."""

    seqs: list[Sequence]
    query_lens: list[int]
    samples: list[bool]  # the sequence's pending tokens all run now: sample its next token
    # Save these pages' KV to host first (the runner returns it in ``ModelRunnerOutput.host_kv``)...
    swap_out: list[tuple[Sequence, list[int]]] = field(default_factory=list)
    # ...then restore host KV into the sequences' new pages. ``None``: the sequence was swapped
    # out earlier in this same step; its KV is what the runner just read.
    swap_in: list[tuple[Sequence, Any]] = field(default_factory=list)
    # Structured outputs: positions, among the sampling sequences, of the constrained ones, and
    # their bitmasks of allowed tokens (numpy [len(grammar_rows), ceil(V / 32)] int32).
    grammar_rows: list[int] = field(default_factory=list)
    grammar_bitmask: Any = None

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)


# With prefix caching: how many sequences at the head of the waiting queue are ordered by
# their cached prefix (bounds the per-refill lookups), and how many admissions one may wait for
# a sibling computing its next block (the starvation bound).
_ADMISSION_WINDOW_PER_SLOT = 2
_MAX_DEFERRALS = 8
# How long one wait for a grammar compile lasts before the scheduler looks at its queues again.
_GRAMMAR_WAIT_S = 1.0


@dataclass(slots=True)
class SchedulerStats:
    num_suspended: int = 0
    num_resumed_swap: int = 0
    num_resumed_recompute: int = 0
    num_recomputed_tokens: int = 0
    num_prefix_query_tokens: int = 0  # tokens of sequences admitted while caching is on
    num_prefix_hit_tokens: int = 0  # of which found in the prefix cache (not computed)


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        blocks: BlockManager,
        max_model_len: int,
        kv_bytes_per_token: int,
        eos_token_ids: frozenset[int] = frozenset(),
        detokenize: Callable[[list[int]], str] | None = None,
        structured: StructuredOutputManager | None = None,
    ):
        self.config = config
        self.blocks = blocks
        self.max_model_len = max_model_len
        self.kv_bytes_per_token = kv_bytes_per_token
        self.eos_token_ids = eos_token_ids
        self.detokenize = detokenize
        self.structured = structured
        self._failed: list[Sequence] = []  # taken out for a bad grammar; finished in ``update``
        self.waiting: deque[Sequence] = deque()
        self.suspended: list[Sequence] = []
        self.running: list[Sequence] = []
        self.host_bytes_used = 0
        self.stats = SchedulerStats()

    # -- queues ---------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        self._attach_grammar(seq)
        self.waiting.append(seq)

    def _attach_grammar(self, seq: Sequence) -> None:
        if seq.params.structured_outputs is None:
            return
        if self.structured is None:
            raise RuntimeError("a sequence with structured_outputs reached a scheduler without a grammar manager")
        self.structured.attach(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.suspended or self.running)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.suspended) + len(self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_queued(self) -> int:
        """Waiting or suspended."""
        return len(self.waiting) + len(self.suspended)

    # -- schedule -------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        swap_out: list[tuple[Sequence, list[int]]] = []
        self._extend(swap_out)
        swap_in = self._refill()
        while not self.running and not self._failed and self._waits_for_grammar():
            # Nothing can run until a grammar compiles: block on the compile thread.
            StructuredOutputManager.wait_any([*self.waiting, *self.suspended], timeout_s=_GRAMMAR_WAIT_S)
            swap_in += self._refill()
        budget = self.config.max_num_batched_tokens
        seqs, query_lens, samples = [], [], []
        # Decoders first (one token each), then prefill chunks in admission order.
        for seq in self.running:
            if seq.num_pending_tokens == 1:
                seqs.append(seq), query_lens.append(1), samples.append(True)
                budget -= 1
        for seq in self.running:
            pending = seq.num_pending_tokens
            if pending > 1 and budget > 0:
                chunk = min(pending, budget)
                seqs.append(seq), query_lens.append(chunk), samples.append(chunk == pending)
                budget -= chunk
        out = SchedulerOutput(seqs, query_lens, samples, swap_out, swap_in)
        if self.structured is not None:
            sampling = [seq for seq, smp in zip(seqs, samples) if smp]
            out.grammar_rows = [row for row, seq in enumerate(sampling) if seq.structured is not None]
            if out.grammar_rows:
                out.grammar_bitmask = self.structured.bitmask([sampling[row] for row in out.grammar_rows])
        return out

    def _waits_for_grammar(self) -> bool:
        return any(seq.structured is not None and not seq.structured.is_ready
                   for seq in (*self.waiting, *self.suspended))

    def _grammar_ready(self, seq: Sequence) -> bool:
        """Whether a queued sequence may be admitted: unconstrained, or its grammar compiled. One
        whose grammar failed is taken out of its queue, to finish as an error row in ``update``."""
        if seq.structured is None or seq.structured.is_ready or self.structured.poll(seq):
            return True
        if seq.structured.error is not None:
            self._take_out(seq)
            self._failed.append(seq)
        return False

    def _extend(self, swap_out: list) -> None:
        """Give each running decoder a slot for its next token, suspending when pages run out."""
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # suspended earlier in this loop
            needed = self.blocks.blocks_for(seq.num_tokens) - len(seq.block_ids)
            while needed > 0 and not self.blocks.can_allocate(needed):
                victim = self._pick_victim()
                self._suspend(victim, swap_out)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING and needed > 0:
                seq.block_ids += self.blocks.allocate(needed)

    def _pick_victim(self) -> Sequence:
        if self.config.suspend_policy == "most_progress":
            # Keep the sequences nearest completion running: the least advanced yields first,
            # the newest among equals.
            return min(reversed(self.running), key=lambda s: s.num_generated)
        return min(reversed(self.running), key=lambda s: s.num_tokens)  # shortest_first

    def _suspend(self, seq: Sequence, swap_out: list) -> None:
        """YIELD to host: keep the KV there if the host pool has room, else drop it (recompute)."""
        self.running.remove(seq)
        seq.transition(SequenceStatus.SUSPENDED)
        seq.num_suspensions += 1
        self.stats.num_suspended += 1
        kv_bytes = seq.num_computed_tokens * self.kv_bytes_per_token
        if seq.num_computed_tokens and self.host_bytes_used + kv_bytes <= self.config.swap_space_bytes:
            swap_out.append((seq, list(seq.block_ids)))
            self.host_bytes_used += kv_bytes
        else:
            seq.num_computed_tokens = 0
        self._free_pages(seq)
        self.suspended.append(seq)

    def _refill(self) -> list[tuple[Sequence, Any]]:
        """Resume suspended sequences, then admit waiting ones, while their pages fit."""
        target = self.config.max_num_seqs
        # Waiting work that all fits starts now: holding a free slot empty for a threshold would
        # only delay it (a job's last rows; a rebalancing actor leases for its empty slots only).
        # Suspended work keeps the threshold: it yielded for memory, so resuming it at once would
        # thrash.
        all_fit = not self.suspended and len(self.waiting) <= target - len(self.running)
        if self.running and len(self.running) >= self.config.refill_threshold * target and not all_fit:
            return []
        swap_in: list[tuple[Sequence, Any]] = []
        # Resume in the policy's order: the sequences that would be kept running come back first.
        self.suspended.sort(
            key=(lambda s: -s.num_generated)
            if self.config.suspend_policy == "most_progress"
            else (lambda s: s.num_tokens)
        )
        for seq in list(self.suspended):
            if len(self.running) >= target:
                break
            if not self._grammar_ready(seq):
                continue  # an imported sequence whose grammar is compiling (or failed)
            swapped = seq.num_computed_tokens > 0  # its KV is on host; else recomputed
            if not self._admit(seq):
                return swap_in
            self.suspended.remove(seq)
            if swapped:
                swap_in.append((seq, seq.host_kv))
                seq.host_kv = None
                self.host_bytes_used -= seq.num_computed_tokens * self.kv_bytes_per_token
                self.stats.num_resumed_swap += 1
            else:
                self.stats.num_resumed_recompute += 1
                self.stats.num_recomputed_tokens += seq.num_tokens - 1 - seq.num_computed_tokens
        if not self.config.enable_prefix_caching:
            compiling: list[Sequence] = []  # set aside while their grammars compile, places kept
            while self.waiting and len(self.running) < target:
                seq = self.waiting[0]
                if not self._grammar_ready(seq):
                    if self.waiting and self.waiting[0] is seq:  # not taken out for a failed grammar
                        compiling.append(self.waiting.popleft())
                    continue
                if not self._admit(seq):
                    break
                self.waiting.popleft()
            self.waiting.extendleft(reversed(compiling))
            return swap_in
        self._admit_in_prefix_order(target)
        return swap_in

    def _admit_in_prefix_order(self, target: int) -> None:
        """Admit waiting sequences longest cached prefix first; defer one whose next block a
        running sequence is computing (see the module NOTE)."""
        window = [self.waiting[i] for i in range(min(len(self.waiting), _ADMISSION_WINDOW_PER_SLOT * target))]
        window = [seq for seq in window if self._grammar_ready(seq)]
        cached = {id(seq): len(self.blocks.lookup(self._prefix_hashes(seq))) for seq in window}
        window.sort(key=lambda seq: -cached[id(seq)])  # stable: arrival order among equals
        computing = {h for seq in self.running for h in seq.block_hashes[seq.num_registered_blocks:]}
        admitted = set()
        for seq in window:
            if len(self.running) >= target:
                break
            hashes, hit = seq.block_hashes, cached[id(seq)]
            if hit < len(hashes) and hashes[hit] in computing and seq.num_deferrals < _MAX_DEFERRALS:
                seq.num_deferrals += 1
                continue
            if not self._admit(seq):
                break
            admitted.add(id(seq))
            computing.update(hashes[hit:])
        if admitted:
            self.waiting = deque(seq for seq in self.waiting if id(seq) not in admitted)

    def _prefix_hashes(self, seq: Sequence) -> list[int]:
        """Hashes of the full blocks the sequence may take from the cache: all but the block
        holding its last token, which is always computed (its logits are needed)."""
        limit = (seq.num_tokens - 1) // self.blocks.block_size
        if len(seq.block_hashes) < limit:
            block_hashes(seq.token_ids, self.blocks.block_size, seq.block_hashes, limit)
        return seq.block_hashes[:limit]

    def _admit(self, seq: Sequence) -> bool:
        """Pages for all of the sequence's tokens (a swapped-in KV plus its pending token); with
        prefix caching, a sequence without KV takes its longest cached prefix as computed."""
        needed = self.blocks.blocks_for(seq.num_tokens)
        headroom = len(self.running)  # one page of growth per running sequence
        cached: list[int] = []
        # A sequence computing prompt logprobs needs every prompt position: no cached prefix.
        caching = (self.config.enable_prefix_caching and seq.num_computed_tokens == 0
                   and seq.params.prompt_logprobs is None)
        if caching:  # looked up again here: an admission just before may have evicted blocks
            cached = self.blocks.lookup(self._prefix_hashes(seq))
        if not self.blocks.can_allocate(needed - len(cached) + self.blocks.num_free_among(cached) + headroom):
            return False
        self.blocks.touch(cached)  # before allocating: a fresh block must not evict these
        seq.block_ids = cached + self.blocks.allocate(needed - len(cached))
        seq.num_registered_blocks = len(cached)
        if caching:
            hit = len(cached) * self.blocks.block_size
            seq.num_computed_tokens = hit
            self.stats.num_prefix_query_tokens += seq.num_tokens
            self.stats.num_prefix_hit_tokens += hit
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = hit
        seq.transition(SequenceStatus.RUNNING)
        self.running.append(seq)
        return True

    # -- update ---------------------------------------------------------------------------------

    def update(self, out: SchedulerOutput, result: ModelRunnerOutput, now_s: float) -> list[Sequence]:
        """Apply one forward's results; return the sequences that finished."""
        for seq, _ in out.swap_out:
            kv = result.host_kv.get(seq.request_id)
            if kv is not None:  # not swapped back in within the same step
                seq.host_kv = kv
        finished = []
        for seq in self._failed:
            seq.finish("error", now_s, error=seq.structured.error)
            finished.append(seq)
        self._failed.clear()
        tokens = iter(result.sampled_token_ids)
        logprobs = iter(result.logprobs or ())
        caching = self.config.enable_prefix_caching
        for seq, qlen, samples in zip(out.seqs, out.query_lens, out.samples):
            seq.num_computed_tokens += qlen
            if caching and seq.num_computed_tokens // self.blocks.block_size > seq.num_registered_blocks:
                self._register_blocks(seq)
            if seq.request_id in result.prompt_logprobs:
                _add_prompt_logprobs(seq, *result.prompt_logprobs[seq.request_id])
            if not samples:
                continue
            token = next(tokens)
            seq.output_token_ids.append(token)
            token_logprobs = next(logprobs, None)
            if seq.params.logprobs is not None:
                if seq.logprobs is None:
                    seq.logprobs = []
                seq.logprobs.append(token_logprobs)
            if seq.first_token_s is None:
                seq.first_token_s = now_s
            error = None if seq.structured is None else self.structured.accept(seq, token)
            reason = "error" if error is not None else self._stop_reason(seq, token)
            if reason is None and seq.structured is not None and self.structured.is_terminated(seq):
                reason = "stop"  # the grammar is complete: nothing but end-of-sequence could follow
            if reason is not None:
                self.running.remove(seq)
                self._free_pages(seq)
                seq.finish(reason, now_s, error=error)
                finished.append(seq)
        return finished

    def _register_blocks(self, seq: Sequence) -> None:
        """Name the sequence's blocks whose KV is now complete in the prefix cache."""
        size = self.blocks.block_size
        full = seq.num_computed_tokens // size
        if len(seq.block_hashes) < full:
            block_hashes(seq.token_ids, size, seq.block_hashes, full)
        for i in range(seq.num_registered_blocks, full):
            self.blocks.cache(seq.block_ids[i], seq.block_hashes[i])
        seq.num_registered_blocks = full

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if not params.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if params.stop_token_ids and token in params.stop_token_ids:
            return "stop"
        if params.stop_strings and self.detokenize is not None and self._hits_stop_string(seq):
            return "stop"
        if seq.num_generated >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _hits_stop_string(self, seq: Sequence) -> bool:
        longest = max(len(s) for s in seq.params.stop_strings)
        tail = self.detokenize(seq.output_token_ids[-(longest + 8) :])
        if not any(s in tail for s in seq.params.stop_strings):
            return False
        text = self.detokenize(seq.output_token_ids)
        cut = min((i for i in (text.find(s) for s in seq.params.stop_strings) if i >= 0), default=-1)
        if cut < 0:
            return False
        seq.stop_text_len = cut
        return True

    # -- errors and migration -------------------------------------------------------------------

    def _free_pages(self, seq: Sequence) -> None:
        self.blocks.free(seq.block_ids)  # cached blocks keep their KV until the space is needed
        seq.block_ids = []
        seq.num_registered_blocks = 0

    def _take_out(self, seq: Sequence) -> None:
        """Remove a queued or running sequence from its queue, freeing its pages and host KV."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._free_pages(seq)
        elif seq.status is SequenceStatus.SUSPENDED:
            self.suspended.remove(seq)
            if seq.host_kv is not None:
                self.host_bytes_used -= seq.num_computed_tokens * self.kv_bytes_per_token
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            raise RuntimeError(f"sequence {seq.request_id} is {seq.status.name}: not in a queue")

    def export(self, seq: Sequence, with_kv: bool = False, kv: Any = None) -> SequenceState:
        """MIGRATE out: take a waiting, running or suspended sequence out of this scheduler and
        return its portable state. ``kv`` is a running sequence's KV read out of its pages
        (the caller's: reading pages needs the KV cache); a suspended one's host KV goes with it
        when ``with_kv``."""
        if seq.status is SequenceStatus.SUSPENDED and with_kv:
            kv = seq.host_kv
        self._take_out(seq)
        seq.transition(SequenceStatus.EXPORTED)
        seq.host_kv = None
        seq.structured = None  # the importing engine replays the output tokens into a new matcher
        return seq.export_state(kv if with_kv else None)

    def import_state(self, state: SequenceState, request_id: int, now_s: float) -> Sequence:
        """MIGRATE in: continue a sequence exported by another engine, as request ``request_id``.

        One that has generated nothing waits like a new request; one mid-generation resumes like
        a suspended one, through the swap-in path when ``state.kv`` holds its KV (it counts in
        the host pool until restored), else by recompute.
        """
        seq = Sequence(request_id, list(state.prompt_token_ids), state.params, state.seed, arrival_s=now_s)
        seq.output_token_ids = list(state.output_token_ids)
        seq.logprobs = None if state.logprobs is None else list(state.logprobs)
        seq.prompt_logprobs = None if state.prompt_logprobs is None else list(state.prompt_logprobs)
        if not seq.output_token_ids:
            self.add(seq)
            return seq
        self._attach_grammar(seq)
        seq.transition(SequenceStatus.SUSPENDED)
        kv_tokens = 0 if state.kv is None else int(state.kv.shape[0])
        if 0 < kv_tokens < seq.num_tokens:
            seq.host_kv = state.kv
            seq.num_computed_tokens = kv_tokens
            self.host_bytes_used += kv_tokens * self.kv_bytes_per_token
        self.suspended.append(seq)
        return seq

    def abort(self, seq: Sequence, reason: str, now_s: float) -> None:
        """Finish a queued or running sequence with an error, freeing what it holds."""
        self._take_out(seq)
        seq.finish("error", now_s, error=reason)


def _add_prompt_logprobs(seq: Sequence, first: int, entries: list) -> None:
    """Record prompt entries from prompt index ``first`` on (a recompute's repeats are dropped)."""
    if seq.prompt_logprobs is None:
        seq.prompt_logprobs = [None]  # the first prompt token has no logprob (vLLM's convention)
    if first == len(seq.prompt_logprobs):
        seq.prompt_logprobs.extend(entries)
