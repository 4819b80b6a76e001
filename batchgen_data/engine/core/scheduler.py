"""The inter-forward scheduler: select, combine, manage pages (paper Algorithm 2). No torch.

NOTE: one step of ``schedule()``:
  0. Grammars. Sequences ``WAITING_FOR_GRAMMAR`` whose compile is done become ``WAITING`` (or
     ``SUSPENDED``, if imported mid-generation) with a matcher; one whose grammar failed is
     taken out and finishes as an error row in this step (``SchedulerOutput.finished``), which
     counts as progress. They keep their places in their queues while compiling.
  1. Extend. Every running sequence gets its pending work for this forward: decoders one token,
     prefilling sequences (new, or resumed by recompute) a chunk of what is left of the token
     budget. A sequence that crosses a KV page boundary gets a new page; when none is free,
     running sequences YIELD to host (suspend) in ``suspend_policy`` order until one is.
  2. Refill. When the running set has fallen below ``refill_threshold * max_num_seqs`` (or is
     empty, or nothing is suspended and all waiting work fits its free slots), suspended
     sequences resume first, then waiting ones are admitted, while their pages fit (keeping one
     page of headroom per running sequence) and the set is below max_num_seqs. With prefix
     caching, a sequence starts after the longest prefix of its blocks already cached (at
     least its last token is computed), and waiting ones are admitted in prefix order
     (``admission.py``: longest cached prefix first, siblings wait for a shared prefix). When
     nothing can run until a grammar compiles, the step waits for one (and only then).
  3. Emit. The running sequences with work this step, in order, and their query lengths, are
     COMBINED into one forward (the model runner splits attention into micro-batches); the
     constrained ones that sample get their grammar's bitmask of allowed tokens.
``update()`` then applies the runner's ``ModelRunnerOutput``: keeps swapped-out KV, commits the
blocks whose KV is now complete to the prefix cache, appends sampled tokens (advancing the
grammars), applies the stop rules and frees finished sequences. A pooling sequence (embed,
classify) is scheduled like any prompt, in chunks; the forward that completes its prompt pools
it instead of sampling, and it finishes there ("stop", no token), its blocks freed at once (their
names stay in the prefix cache for rows sharing the prefix).
Per-sequence Python work here is O(1) per step; page work happens once per page of tokens.

The scheduler keeps policy; the KV manager (``kv_manager.py``) owns blocks and the prefix cache,
the host pool (``host_pool.py``) the swapped KV's bytes. The scheduler alone writes its queues and
its records' statuses and host KV, through its methods (``add``, ``schedule``, ``update``, and
``export``, ``import_state``, ``abort`` in ``scheduler_migrate.py``); every status change goes
through ``Sequence.transition``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from batchgen_data.config import EngineConfig
from batchgen_data.engine.core.admission import ADMISSION_WINDOW_PER_SLOT, plan_prefix_admission
from batchgen_data.engine.core.grammar_gate import GrammarGate
from batchgen_data.engine.core.host_pool import HostKVPool
from batchgen_data.engine.core.kv_manager import KVCacheManager
from batchgen_data.engine.core.request import NewRequest
from batchgen_data.engine.core.runner_output import ModelRunnerOutput
from batchgen_data.engine.core.scheduler_migrate import MigrateMethods
from batchgen_data.engine.core.scheduler_output import SchedulerOutput, SchedulerStats, combine
from batchgen_data.engine.core.sequence import Sequence, SequenceStatus
from batchgen_data.engine.core.stop_rules import StopChecker, add_prompt_logprobs
from batchgen_data.engine.core.suspend_policy import pick_victim, resume_order
from batchgen_data.engine.spec.drafter import Drafter

if TYPE_CHECKING:
    from batchgen_data.engine.structured.manager import StructuredOutputManager

S = SequenceStatus


class Scheduler(MigrateMethods):
    """Policy over one KV pool of ``num_blocks`` blocks (see the module NOTE)."""

    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int,
        max_model_len: int,
        kv_bytes_per_token: int,
        eos_token_ids: frozenset[int] = frozenset(),
        detokenize: Callable[[list[int]], str] | None = None,
        structured: StructuredOutputManager | None = None,  # grammars (structured outputs)
    ):
        self.config = config
        # Speculative decoding (``engine/spec/drafter.py``): None without a speculative_config.
        spec = config.speculative_config
        self.drafter = Drafter(spec, max_model_len) if spec is not None else None
        self.last_num_generated = 0  # tokens the last ``update`` appended
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                 config.prefix_caching_hash_algo)
        self.kv_bytes_per_token = kv_bytes_per_token
        self.host = HostKVPool(config.swap_space_bytes, kv_bytes_per_token)
        self.grammars = GrammarGate(structured)
        self.stops = StopChecker(eos_token_ids, max_model_len, detokenize, self.grammars)
        self.waiting: deque[Sequence] = deque()
        self.suspended: list[Sequence] = []
        self.running: list[Sequence] = []
        self._imported_kv: list[tuple[Sequence, Any]] = []  # admitted on import: KV restored next step
        self.stats = SchedulerStats()

    # -- queues ---------------------------------------------------------------------------------

    def add_request(self, request: NewRequest) -> Sequence:
        """Queue a new request under the scheduler's own record of it."""
        seq = Sequence(request.request_id, list(request.prompt_token_ids), request.params, request.seed,
                       arrival_s=request.arrival_s)
        self.add(seq)
        return seq

    def add(self, seq: Sequence) -> None:
        self.grammars.attach(seq)
        self.waiting.append(seq)

    def find(self, request_id: int) -> Sequence | None:
        """The record of a queued or running request (a scan: MIGRATE is rare, and taking a
        record out of its queue scans that queue anyway)."""
        for queue in (self.running, self.suspended, self.waiting):
            for seq in queue:
                if seq.request_id == request_id:
                    return seq
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.suspended or self.running)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.suspended) + len(self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def compiling(self) -> list[Sequence]:
        """Queued sequences ``WAITING_FOR_GRAMMAR`` (also in ``waiting`` or ``suspended``)."""
        return self.grammars.compiling

    @property
    def host_bytes_used(self) -> int:
        return self.host.used_bytes

    @property
    def num_queued(self) -> int:
        """Waiting (or waiting for a grammar) or suspended."""
        return len(self.waiting) + len(self.suspended)

    # -- schedule -------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        finished = self._poll_grammars()
        swap_out: list[tuple[Sequence, list[int]]] = []
        self._extend(swap_out)
        swap_in = self._imported_kv + self._refill()
        self._imported_kv = []
        while not self.running and not finished and self.grammars.compiling:
            self.grammars.wait_any()  # nothing can run until a grammar compiles
            finished = self._poll_grammars()
            swap_in += self._refill()
        if self.grammars.compiling and not finished and all(s.num_generated == 0 for s in self.running):
            self.grammars.wait_all()  # a step of new sequences alone: the rest join it (GRAMMAR_JOIN_S)
            finished = self._poll_grammars()
            swap_in += self._refill()
        if self.drafter is not None:
            self.drafter.draft(self.running, self.kv, self.config.max_num_batched_tokens, self.grammars)
        out = SchedulerOutput(*combine(self.running, self.config.max_num_batched_tokens,
                                      self.config.enable_chunked_prefill), swap_out, swap_in,
                              finished=finished)
        if self.grammars.structured is not None:
            out.grammar_rows, out.grammar_bitmask, out.grammar_lazy = self.grammars.bitmask(out.sampling_seqs)
        if self.drafter is not None:
            out.num_mtp_drafts = self.drafter.lookahead(self.running)
        return out

    def _poll_grammars(self) -> list[Sequence]:
        """Compiled sequences go on; those whose grammar failed are taken out (they finish as
        errors in ``update``)."""
        failed = self.grammars.poll(self.suspended)
        for seq in failed:
            self._take_out(seq)
        return failed

    def _extend(self, swap_out: list) -> None:
        """Give each running decoder a slot for its next token, suspending when pages run out."""
        kv = self.kv
        for seq in list(self.running):
            if seq.status is not S.RUNNING:
                continue  # suspended earlier in this loop
            needed = kv.num_blocks_needed(seq)
            while needed > 0 and not kv.can_allocate(needed):
                victim = pick_victim(self.running, self.config.suspend_policy)
                self._suspend(victim, swap_out)
                if victim is seq:
                    break
            if seq.status is S.RUNNING and needed > 0:
                kv.append_slots(seq, needed)

    def _suspend(self, seq: Sequence, swap_out: list) -> None:
        """YIELD to host: keep the KV there if the host pool has room, else drop it (recompute)."""
        self.running.remove(seq)
        seq.transition(S.SUSPENDED)
        seq.num_suspensions += 1
        self.stats.num_suspended += 1
        if seq.num_computed_tokens and self.host.reserve(seq.num_computed_tokens):
            swap_out.append((seq, list(seq.block_ids)))
        else:
            seq.num_computed_tokens = 0
        self.kv.free(seq)
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
        self.suspended.sort(key=resume_order(self.config.suspend_policy))
        for seq in [s for s in self.suspended if s.status is S.SUSPENDED]:
            if len(self.running) >= target:
                break
            swapped = seq.num_computed_tokens > 0  # its KV is on host; else recomputed
            if not self._admit(seq, self.kv.computed_prefix(seq)):
                return swap_in
            self.suspended.remove(seq)
            if swapped:
                swap_in.append((seq, seq.host_kv))
                seq.host_kv = None
                self.host.release(seq.num_computed_tokens)
                self.stats.num_resumed_swap += 1
            else:
                self.stats.num_resumed_recompute += 1
                self.stats.num_recomputed_tokens += seq.num_tokens - 1 - seq.num_computed_tokens
        if self.config.enable_prefix_caching:
            self._admit_in_prefix_order(target)
        else:
            self._admit_in_order(target)
        return swap_in

    def _admit_in_order(self, target: int) -> None:
        """FIFO admission; sequences still waiting for their grammar keep their places."""
        compiling: list[Sequence] = []  # set aside from the head, put back in order
        while self.waiting and len(self.running) < target:
            seq = self.waiting[0]
            if seq.status is S.WAITING_FOR_GRAMMAR:
                compiling.append(self.waiting.popleft())
            elif self._admit(seq, []):
                self.waiting.popleft()
            else:
                break
        self.waiting.extendleft(reversed(compiling))

    def _admit_in_prefix_order(self, target: int) -> None:
        """Admit waiting sequences in prefix order (``admission.py``)."""
        head = [self.waiting[i] for i in range(min(len(self.waiting), ADMISSION_WINDOW_PER_SLOT * target))]
        plan, deferred = plan_prefix_admission([seq for seq in head if seq.status is S.WAITING], self.kv,
                                               self.running, target - len(self.running))
        for seq in deferred:
            seq.num_deferrals += 1
        admitted = set()
        for seq in plan:  # its prefix looked up again: an admission just before may have evicted blocks
            if not self._admit(seq, self.kv.computed_prefix(seq)):
                break
            admitted.add(id(seq))
        if admitted:
            self.waiting = deque(seq for seq in self.waiting if id(seq) not in admitted)

    def _admit(self, seq: Sequence, computed: list[int]) -> bool:
        """Pages for all of the sequence's tokens (a swapped-in KV plus its pending token), the
        ``computed`` prefix from the cache taken as computed."""
        if not self.kv.can_admit(seq, computed, headroom=len(self.running)):  # a page per running seq
            return False
        hit = self.kv.admit(seq, computed)
        if self.config.enable_prefix_caching and seq.num_computed_tokens == 0 and not seq.computes_whole_prompt:
            seq.num_computed_tokens = hit
            self.stats.num_prefix_query_tokens += seq.num_tokens
            self.stats.num_prefix_hit_tokens += hit
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = hit
        seq.transition(S.RUNNING)
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
        for seq in out.finished:
            seq.finish("error", now_s, error=seq.structured.error)
            finished.append(seq)
        tokens = iter(result.sampled_token_ids)
        logprobs = iter(result.logprobs or ())
        self.last_num_generated = 0
        for seq, qlen, samples in zip(out.seqs, out.query_lens, out.samples):
            if seq.draft_token_ids:  # speculative: k + 1 positions sampled, the matching prefix kept
                self._accept_draft(seq, [next(tokens) for _ in range(qlen)],
                                   [next(logprobs, None) for _ in range(qlen)], now_s, finished)
                continue
            seq.num_computed_tokens += qlen
            self.kv.commit(seq)
            if seq.request_id in result.prompt_logprobs:
                add_prompt_logprobs(seq, *result.prompt_logprobs[seq.request_id])
            if not samples:
                continue
            if seq.is_pooling:  # its prompt is computed: pooled, done
                seq.pooled_data = result.pooled_data[seq.request_id]
                self._finish(seq, "stop", now_s)
                finished.append(seq)
                continue
            self._append(seq, next(tokens), next(logprobs, None), now_s, finished)
        for seq in out.seqs:  # an MTP layer's drafts for the rows' next step
            draft = result.draft_token_ids.get(seq.request_id)
            seq.mtp_draft = (seq.num_tokens, draft) if draft and seq.status is S.RUNNING else None
        return finished

    def _append(self, seq: Sequence, token: int, token_logprobs, now_s: float, finished: list[Sequence]) -> bool:
        """Append a sampled token and apply the stop rules; whether the sequence finished."""
        seq.append_token(token, token_logprobs, now_s)
        self.last_num_generated += 1
        reason, error = self.stops.check(seq, token)
        if reason is None:
            return False
        self._finish(seq, reason, now_s, error)
        finished.append(seq)
        return True

    def _accept_draft(self, seq: Sequence, sampled: list[int], logprobs: list, now_s: float,
                      finished: list[Sequence]) -> None:
        """A drafted row's tokens (``Drafter.accept``), each through the stop rules in turn: the
        KV of the pending token and the accepted draft tokens is kept, the rest is overwritten
        later; only then are full blocks named in the prefix cache."""
        kept = self.drafter.accept(seq, sampled)
        seq.num_computed_tokens += len(kept)  # the pending token and the accepted draft tokens
        for token, token_logprobs in zip(kept, logprobs):
            if self._append(seq, token, token_logprobs, now_s, finished):
                return
        self.kv.commit(seq)

    def _finish(self, seq: Sequence, reason: str, now_s: float, error: str | None = None) -> None:
        """A running sequence is done: out of the running set, its blocks freed."""
        self.running.remove(seq)
        self.kv.free(seq)
        seq.finish(reason, now_s, error=error)
        if self.drafter is not None:
            self.drafter.finished(seq)
