"""What a worker reports for the rebalancer to weigh: its live sequences (``SeqProgress``) and its
load report (``WorkerProgress``: an actor's, sent with each lease call; or an expert-parallel
rank's, built by its engine's driver). Plain data, pure Python."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from batchgen_data.budget import tokens_left
from batchgen_data.hardware import ComputeShare
from batchgen_data.rebalance.core.step_model import StepModel, StepSums


@dataclass(frozen=True, slots=True)
class SeqProgress:
    """One live sequence of an engine."""

    num_generated: int
    max_tokens: int
    num_tokens: int  # prompt plus output: the KV a move ships or the receiver recomputes
    started: bool  # running or suspended (False: waiting, nothing computed yet)
    movable: bool = True
    running: bool = True  # in the running set now (False: waiting, or suspended for KV memory)
    request_id: int = -1  # the engine's id for it: what a planned move names (-1: not known)
    in_pool: bool = True  # False: a row its actor started outside the stage's pool (adopted if it moves)

    @property
    def num_tokens_left(self) -> int:
        """Tokens it may still generate (its ``max_tokens`` budget left)."""
        return tokens_left(self.max_tokens, self.num_generated)



@dataclass(frozen=True, slots=True)
class WorkerProgress:
    """A worker's load report (an actor's, sent with each lease call; or a rank's, built by its
    engine's driver)."""

    slots: int  # sequences its engine runs at once (max_num_seqs)
    # Running ones first, then suspended, then waiting; last, those leased that have not reached
    # its engine yet (waiting, not movable: the engine has no id for them yet).
    seqs: tuple[SeqProgress, ...] = ()
    step: StepSums = field(default_factory=StepSums)
    move_s_per_token: float = 0.0  # min(KV transfer, recompute) per token, from its engine's rates
    move_latency_s: float = 0.1  # fixed cost of one move: round trips and a step of the receiver
    kv_s_per_token: float = math.inf  # shipping one token's KV (``MigrationCosts.transfer_s(1)``)
    compute: ComputeShare | None = None  # what its engine's steps use of its machine (None: unknown)
    # Output tokens its sequences outside the pool have left (rows an actor started on its own
    # engine before the stage had a pool): work it holds that the pool has no items for.
    local_tokens: int = 0
    # Its batch calls running now, and the most it runs at once (None: not known). An actor with
    # a call slot free tells the stage that Ray Data has no block waiting for it: the input it
    # will get is all in the pool or on the engines (``pacing``).
    calls: int = 0
    max_calls: int | None = None

    @property
    def free_slots(self) -> int:
        return max(0, self.slots - len(self.seqs))

    @property
    def run_slots(self) -> int:
        """Sequences its engine runs at once: ``slots``, or, while some are suspended for want of
        KV memory, as many as it runs now (the rest wait for memory, not for a slot)."""
        if any(s.started and not s.running for s in self.seqs):
            return max(1, sum(1 for s in self.seqs if s.running))
        return self.slots

    @property
    def ships_kv(self) -> bool:
        """Its started sequences move with their KV (shipping beats recomputing it)."""
        return self.kv_s_per_token <= self.move_s_per_token

    def advanced(self, seconds: float, model: StepModel | None) -> WorkerProgress:
        """This report as it stands ``seconds`` after it was taken, by the step model: the
        running sequences, and the waiting ones that fit in its free running slots, a token
        further per step; those that reach their ``max_tokens`` gone. (A worker reports again
        whenever it leases; between two of its calls, the pool plans with its report carried
        forward this way.)"""
        num_free = max(0, self.run_slots - sum(1 for s in self.seqs if s.running))
        runs = []
        for s in self.seqs:
            starts = not s.started and num_free > 0
            num_free -= starts
            runs.append(s.running or starts)
        if seconds <= 0 or model is None or not any(runs) or model.step_s(sum(runs)) <= 0:
            return self
        steps = int(seconds / model.step_s(sum(runs)))
        if not steps:
            return self
        seqs = []
        for s, runs_on in zip(self.seqs, runs):
            if runs_on:
                if s.num_generated + steps >= s.max_tokens:
                    continue  # finished by now
                s = replace(s, num_generated=s.num_generated + steps, num_tokens=s.num_tokens + steps,
                            started=True, running=True)
            seqs.append(s)
        return replace(self, seqs=tuple(seqs))

