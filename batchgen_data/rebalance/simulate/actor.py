"""One modelled actor: its engine's running set and queue (``SimEngine``), stepped by the step
model, and its load report as a real actor's client builds it (``report``)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from batchgen_data.rebalance.core.progress import SeqProgress, WorkerProgress
from batchgen_data.rebalance.core.step_model import StepSums
from batchgen_data.rebalance.simulate.model import ActorModel


@dataclass(slots=True)
class SimSeq:
    row: int  # index into the scenario
    call: int  # the owner call (block) it belongs to
    prompt_tokens: int
    output_tokens: int
    max_tokens: int
    item_id: str | None = None  # its pool item (None: run outside the pool, not movable)
    num_generated: int = 0
    started: bool = False
    movable: bool = False  # a pool item that may be given back again (``WorkItem.movable``)
    arrive_s: float = 0.0  # extra seconds its admission costs: shipped KV, or tokens to recompute
    request_id: int = -1

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.num_generated

    @property
    def full_length(self) -> int:
        return self.prompt_tokens + self.max_tokens


@dataclass(slots=True)
class SimEngine:
    """An engine: at most ``max_num_seqs`` sequences run, each reserving its full length of KV;
    the others wait in order."""

    name: str
    model: ActorModel
    max_num_seqs: int
    running: list[SimSeq] = field(default_factory=list)
    waiting: deque[SimSeq] = field(default_factory=deque)
    kv_used: int = 0
    next_id: int = 0
    busy_s: float = 0.0  # seconds spent stepping

    def add(self, seq: SimSeq, front: bool = False) -> None:
        seq.request_id = self.next_id
        self.next_id += 1
        (self.waiting.appendleft if front else self.waiting.append)(seq)

    def admit(self) -> float:
        """Start waiting sequences while slots and KV allow (in order, as the scheduler does);
        the extra seconds the next step spends on their prefill (or their moved-in KV)."""
        extra = 0.0
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self.running and self.kv_used + seq.full_length > self.model.kv_capacity_tokens:
                break
            self.waiting.popleft()
            self.kv_used += seq.full_length
            if not seq.started:
                extra += seq.arrive_s or seq.prompt_tokens * self.model.prefill_s_per_token
                seq.started, seq.arrive_s = True, 0.0
            self.running.append(seq)
        return extra

    def step(self) -> list[SimSeq]:
        """One token for every running sequence; the ones that end leave (returned)."""
        done, still = [], []
        for seq in self.running:
            seq.num_generated += 1
            (done if seq.num_generated >= seq.output_tokens else still).append(seq)
        self.running = still
        for seq in done:
            self.kv_used -= seq.full_length
        return done

    def take(self, request_ids: set[int]) -> list[SimSeq]:
        """Export these sequences (a planned move): they leave the engine, and their KV with them."""
        out = [s for s in (*self.running, *self.waiting) if s.request_id in request_ids]
        self.kv_used -= sum(s.full_length for s in self.running if s.request_id in request_ids)
        self.running = [s for s in self.running if s.request_id not in request_ids]
        self.waiting = deque(s for s in self.waiting if s.request_id not in request_ids)
        return out

    @property
    def num_seqs(self) -> int:
        return len(self.running) + len(self.waiting)

    def report(self, step: StepSums, move_latency_s: float, calls: int = 0, max_calls: int | None = None,
               ) -> WorkerProgress:
        """Its load report (``WorkerProgress``), as the stage's client sends with each lease:
        running sequences first, then waiting ones; pool items movable while their move budget
        lasts, its own rows (started outside the pool) movable once the stage has a pool."""
        seqs = tuple(
            SeqProgress(s.num_generated, s.max_tokens, s.num_tokens, s.started, movable=s.movable,
                        running=running, request_id=s.request_id, in_pool=s.item_id is not None)
            for s, running in [*((s, True) for s in self.running), *((s, False) for s in self.waiting)])
        local = sum(s.max_tokens - s.num_generated + 1 for s in (*self.running, *self.waiting) if s.item_id is None)
        return WorkerProgress(slots=self.max_num_seqs, seqs=seqs, step=step,
                              move_s_per_token=self.model.move_s_per_token, move_latency_s=move_latency_s,
                              kv_s_per_token=self.model.kv_s_per_token, local_tokens=local,
                              calls=calls, max_calls=max_calls)
