"""MIGRATE out and in, and abort: the scheduler's methods that take a record out of its queues
or put a continued one in (``Scheduler`` inherits them; they write only the scheduler's own
queues and records, like the rest of its methods). No torch.
"""

from __future__ import annotations

from typing import Any

from batchgen_data.engine.core.sequence import Sequence, SequenceState, SequenceStatus

S = SequenceStatus


class MigrateMethods:
    """``export``, ``import_state``, ``abort`` and the queue removal they share."""

    def _take_out(self, seq: Sequence) -> None:
        """Remove a queued or running sequence from its queue, freeing its pages and host KV."""
        self.grammars.discard(seq)
        if seq.status is S.RUNNING:
            self._imported_kv = [(s, kv) for s, kv in self._imported_kv if s is not seq]
            self.running.remove(seq)
            self.kv.free(seq)
        elif seq in self.suspended:
            self.suspended.remove(seq)
            if seq.host_kv is not None:
                self.host.release(seq.num_computed_tokens)
        elif seq.status in (S.WAITING, S.WAITING_FOR_GRAMMAR):
            self.waiting.remove(seq)
        else:
            raise RuntimeError(f"sequence {seq.request_id} is {seq.status.name}: not in a queue")

    def export(self, seq: Sequence, with_kv: bool = False, kv: Any = None) -> SequenceState:
        """MIGRATE out: take a waiting, running or suspended sequence out of this scheduler and
        return its portable state. ``kv`` is a running sequence's KV read out of its pages
        (the caller's: reading pages needs the KV cache); a suspended one's host KV goes with it
        when ``with_kv``."""
        if seq.status is S.SUSPENDED and with_kv:
            kv = seq.host_kv
        self._take_out(seq)
        seq.transition(S.EXPORTED)
        seq.host_kv = None
        seq.structured = None  # the importing engine replays the output tokens into a new matcher
        return seq.export_state(kv if with_kv else None)

    def import_state(self, state: SequenceState, request_id: int, now_s: float) -> Sequence:
        """MIGRATE in: continue a sequence exported by another engine, as request ``request_id``.

        One that has generated nothing waits like a new request; one mid-generation resumes like
        a suspended one, through the swap-in path when ``state.kv`` holds its KV: at once, into
        pages it gets now, when a running slot and the pages are free; else held in the host pool
        until it resumes, if ``swap_space_bytes`` has room; else by recompute.
        """
        seq = Sequence.from_state(state, request_id, now_s)
        if not seq.output_token_ids:
            self.add(seq)
            return seq
        self.grammars.attach(seq)
        if seq.status is S.WAITING:
            seq.transition(S.SUSPENDED)
        kv_tokens = 0 if state.kv is None else int(state.kv.shape[0])
        if 0 < kv_tokens < seq.num_tokens:
            seq.num_computed_tokens = kv_tokens
            if self._admit_imported(seq, state.kv):
                return seq
            if self.host.reserve(kv_tokens):
                seq.host_kv = state.kv
            else:
                seq.num_computed_tokens = 0  # no room for its KV anywhere: recomputed on resume
        self.suspended.append(seq)
        return seq

    def _admit_imported(self, seq: Sequence, kv: Any) -> bool:
        """Give an imported sequence with shipped KV pages now, if a slot and its pages are
        free: the next step restores the KV into them (no host holding). One still waiting for
        its grammar, or with no room, waits as suspended."""
        if seq.status is not S.SUSPENDED or len(self.running) >= self.config.max_num_seqs:
            return False
        if not self._admit(seq, []):
            return False
        self._imported_kv.append((seq, kv))
        self.stats.num_resumed_swap += 1
        return True

    def abort(self, seq: Sequence, reason: str, now_s: float) -> None:
        """Finish a queued or running sequence with an error, freeing what it holds."""
        self._take_out(seq)
        seq.finish("error", now_s, error=reason)
