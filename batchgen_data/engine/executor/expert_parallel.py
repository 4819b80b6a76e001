"""``ExpertParallelExecutor``: an engine's sequences over N rank processes (DP attention, EP MoE).

The engine (``engine/engine.py``) tokenizes, validates and numbers requests and assembles
outputs; this executor places each sequence on a rank. Each rank (``rank_worker.py``) holds its
E/N experts of every MoE layer and runs its own sequences with an ``InProcessExecutor`` — its
own scheduler, KV pool and sampler, as each data-parallel attention rank does — and every MoE
layer exchanges routed tokens with the other ranks by DeepSpeed-MoE all-to-all.

NOTE: one ``step``.
  1. Place: new sequences go to the rank with the fewest tokens left to generate (its unfinished
     budgets plus what this step already gave it).
  2. Even out the tail: once nothing new is waiting here, a rank with queued sequences gives its
     unstarted ones to a rank with free slots; a rank running two or more sequences more than an
     idle rank gives half the gap, the ones worth moving by the same cost rule as across actors
     (``MigrationCosts``: KV shipped or recomputed). What a rank exports this step is imported by
     its receiver next step.
  3. Lockstep: every rank gets one command and runs exactly one forward — zero tokens if it has
     nothing — so every all-to-all has all its ranks; the answers carry the finished sequences.
The driver keeps one ``Sequence`` per request for the engine's caller and mirrors each rank's
answer into it (first token, output, finish).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

from batchgen_data.config import EngineConfig
from batchgen_data.engine.executor.comm_time import split_comm_time
from batchgen_data.engine.executor.rank_group import RankGroup
from batchgen_data.engine.executor.rank_protocol import NewSequence, RankCommand, RankLoad, StepResult
from batchgen_data.engine.core.sequence import Sequence, SequenceState, SequenceStatus
from batchgen_data.engine.stats import EngineStats, RankStats
from batchgen_data.errors import BatchGenError, ConfigError
from batchgen_data.model.config import ModelConfig
from batchgen_data.model.moe.store import ExpertShard

# A sequence moves between ranks at most this often (bounds ping-pong at the tail).
_MAX_RANK_MOVES = 2


class ExpertParallelExecutor:
    """``config.expert_parallel_size`` rank processes in lockstep (see the module NOTE)."""

    def __init__(self, model_path: str | os.PathLike, config: EngineConfig, model_config: ModelConfig,
                 clock: Callable[[], float]):
        world = config.expert_parallel_size
        if not model_config.sparse_layer_ids:
            raise ConfigError("expert_parallel_size > 1 needs a model with MoE layers")
        ExpertShard(0, world).owned(model_config.num_experts)  # ConfigError unless N divides E
        self.config = config
        self._clock = clock
        self.group = RankGroup(model_path, config, world)
        first = self.group.ready[0]
        self._num_kv_blocks, self._block_size = first.num_kv_blocks, first.block_size  # what a request must fit
        self._kv_bytes_per_token = first.kv_bytes_per_token
        self._unplaced: list[Sequence] = []
        self._live: dict[int, Sequence] = {}  # request id -> the caller's Sequence
        self._rank_of: dict[int, int] = {}
        self._moves: dict[int, int] = {}
        self._inbound: list[list[SequenceState]] = [[] for _ in range(world)]
        self._loads = [RankLoad(0, 0, 0, config.max_num_seqs) for _ in range(world)]
        self._rank_stats: list[RankStats] = []
        self._last_results: list[StepResult] = []
        self._num_steps = 0

    # -- what the engine asks ----------------------------------------------------------------------

    @property
    def num_kv_blocks(self) -> int:
        """One rank's pool: what a request must fit."""
        return self._num_kv_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def kv_bytes_per_token(self) -> int:
        return self._kv_bytes_per_token

    @property
    def max_running_seqs(self) -> int:
        return self.config.max_num_seqs * self.config.expert_parallel_size

    @property
    def num_unfinished(self) -> int:
        return len(self._live)

    # -- step --------------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        self._unplaced.append(seq)
        self._live[seq.request_id] = seq

    def step(self) -> list[Sequence]:
        """One lockstep forward on every rank; returns the sequences that finished in it."""
        commands = [RankCommand(imports=inbound) for inbound in self._inbound]
        self._inbound = [[] for _ in commands]
        self._place(commands)
        targets = self._plan_tail(commands)
        results = self.group.step(commands)
        now = self._clock()
        finished = []
        for result in results:
            finished += self._apply(result, now)
        for giver, receiver in targets.items():
            for state in results[giver].exported:
                self._rank_of[state.request_id] = receiver
                self._moves[state.request_id] = self._moves.get(state.request_id, 0) + 1
                self._inbound[receiver].append(state)
        self._loads = [r.load for r in results]
        self._rank_stats = [r.stats for r in results]
        self._last_results = results
        self._num_steps += 1
        return finished

    def _place(self, commands: list[RankCommand]) -> None:
        """New requests to the rank with the fewest tokens left (what it reported, plus what it
        is given now)."""
        tokens_left = [load.tokens_left for load in self._loads]
        for seq in self._unplaced:
            rank = min(range(len(commands)), key=lambda r: (tokens_left[r], r))
            commands[rank].add.append(NewSequence(seq.request_id, seq.prompt_token_ids, seq.params, seq.seed))
            tokens_left[rank] += seq.params.max_tokens
            self._rank_of[seq.request_id] = rank
        self._unplaced = []

    def _plan_tail(self, commands: list[RankCommand]) -> dict[int, int]:
        """MIGRATE between ranks (giver -> receiver), decided from the last step's loads."""
        if any(c.add or c.imports for c in commands):
            return {}
        loads = self._loads
        order = sorted(range(len(loads)), key=lambda r: loads[r].num_running + loads[r].num_queued)
        receiver, giver = order[0], order[-1]
        if receiver == giver or loads[receiver].num_queued or loads[receiver].free_slots <= 0:
            return {}
        count = 0
        if loads[giver].num_queued:  # unstarted or suspended work waits there while a slot is free here
            count = min(loads[giver].num_queued, loads[receiver].free_slots)
        elif loads[giver].num_running - loads[receiver].num_running >= 2 and loads[receiver].num_running == 0:
            count = min((loads[giver].num_running - loads[receiver].num_running) // 2, loads[receiver].free_slots)
        if count <= 0:
            return {}
        movable = sum(1 for rid, r in self._rank_of.items() if r == giver and self._moves.get(rid, 0) < _MAX_RANK_MOVES)
        commands[giver].export_count = min(count, movable)
        return {giver: receiver} if commands[giver].export_count else {}

    def _apply(self, result: StepResult, now: float) -> list[Sequence]:
        """Mirror one rank's answer into the caller's sequences."""
        for rid in result.started:
            seq = self._live.get(rid)
            if seq is not None and seq.first_token_s is None:
                seq.first_token_s = now
        finished = []
        for done in result.finished:
            seq = self._live.pop(done.request_id, None)
            self._rank_of.pop(done.request_id, None)
            self._moves.pop(done.request_id, None)
            if seq is None:
                continue
            seq.output_token_ids = list(done.output_token_ids)
            seq.stop_text_len = done.stop_text_len
            seq.num_cached_tokens = done.num_cached_tokens
            seq.logprobs, seq.prompt_logprobs = done.logprobs, done.prompt_logprobs
            if seq.first_token_s is None and seq.output_token_ids:
                seq.first_token_s = now
            seq.finish(done.finish_reason, now, error=done.error)
            finished.append(seq)
        return finished

    def step_fields(self) -> dict:
        results = self._last_results
        return {
            "num_running": sum(r.load.num_running for r in results),
            "num_waiting": sum(r.load.num_queued for r in results) + len(self._unplaced),
            "num_tokens": sum(r.num_tokens for r in results),
            "num_sampled": sum(len(r.finished) for r in results),
            "rank_tokens": [r.num_tokens for r in results],
            "rank_step_s": [r.step_s for r in results],
            "rank_comm_s": [r.comm_s for r in results],
            **split_comm_time([r.comm_spans for r in results]),
        }

    # -- MIGRATE across engines --------------------------------------------------------------------

    def export(self, seq: Sequence, with_kv: bool = False) -> SequenceState:
        if seq.request_id not in self._live:
            raise BatchGenError(f"only waiting, suspended or running sequences can be exported, not {seq.status.name}")
        if seq in self._unplaced:
            self._unplaced.remove(seq)
            state = seq.export_state()
        else:
            rank = self._rank_of[seq.request_id]
            inbound = next((s for s in self._inbound[rank] if s.request_id == seq.request_id), None)
            if inbound is not None:  # between ranks right now: hand on the state it travels with
                self._inbound[rank].remove(inbound)
                state = inbound
            else:
                commands = [RankCommand(step=False) for _ in range(self.config.expert_parallel_size)]
                commands[rank].export_ids, commands[rank].export_with_kv = [seq.request_id], with_kv
                state = self.group.step(commands)[rank].exported[0]
        del self._live[seq.request_id]
        self._rank_of.pop(seq.request_id, None)
        seq.transition(SequenceStatus.EXPORTED)
        return state

    def import_state(self, state: SequenceState, request_id: int) -> Sequence:
        """Continue ``state`` as request ``request_id``, on the rank with the fewest tokens left."""
        seq = Sequence(request_id, list(state.prompt_token_ids), state.params, state.seed, arrival_s=self._clock())
        seq.output_token_ids = list(state.output_token_ids)
        state = dataclasses.replace(state, request_id=request_id)
        rank = min(range(len(self._loads)), key=lambda r: (self._loads[r].tokens_left, r))
        self._inbound[rank].append(state)
        self._rank_of[request_id] = rank
        self._live[request_id] = seq
        return seq

    # -- stats and lifetime ------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        ranks = self._rank_stats
        calls = sum(r.expert_calls for r in ranks)
        return EngineStats(
            num_requests=0,
            num_finished=0,
            num_generated_tokens=sum(r.num_generated_tokens for r in ranks),
            num_forwards=self._num_steps,
            num_forward_tokens=sum(r.num_forward_tokens for r in ranks),
            mean_tokens_per_expert_call=sum(r.expert_tokens for r in ranks) / calls if calls else 0.0,
            kernel_s=max((r.kernel_s for r in ranks), default=0.0),
            busy_s=0.0,
            num_suspended=sum(r.num_suspended for r in ranks),
            num_resumed_swap=sum(r.num_resumed_swap for r in ranks),
            num_resumed_recompute=sum(r.num_resumed_recompute for r in ranks),
            num_recomputed_tokens=sum(r.num_recomputed_tokens for r in ranks),
            num_kv_blocks=self._num_kv_blocks,
            num_idle_forwards=sum(r.num_idle_forwards for r in ranks),
            expert_comm_s=sum(r.expert_comm_s for r in ranks),
            expert_weight_bytes=max((r.expert_weight_bytes for r in ranks), default=0),
            ranks=list(ranks),
            prefix_cache_queries=sum(r.prefix_cache_queries for r in ranks),
            prefix_cache_hits=sum(r.prefix_cache_hits for r in ranks),
        )

    def close(self) -> None:
        """Stop the rank processes."""
        self.group.close()
