"""``ExpertParallelExecutor``: an engine's sequences over N rank processes (DP attention, EP MoE).

The engine (``engine/engine.py``) tokenizes, validates and numbers requests and assembles
outputs; this executor places each request on a rank. Each rank (``rank_worker.py``) holds its
E/N experts of every MoE layer and runs its own sequences with an ``InProcessExecutor`` — its
own scheduler, KV pool and sampler, as each data-parallel attention rank does — and every MoE
layer exchanges routed tokens with the other ranks by DeepSpeed-MoE all-to-all.

NOTE: one ``step``.
  1. Place: new sequences go to the rank with the fewest tokens left to generate (its unfinished
     budgets plus what this step already gave it).
  2. Even out the tail: once nothing new is being placed, the engine's one move rule
     (``migration/planner.py``, the same as across actors) names the requests a rank gives to a
     rank with free slots, from the progress the ranks published (queued work that starts
     clearly sooner there; ``_plan_tail``), each with whether its KV travels (``MigrationCosts``).
     The giver exports exactly those this step; the receiver imports them next step.
  3. Lockstep: every rank gets one command and runs exactly one forward — zero tokens if it has
     nothing — so every all-to-all has all its ranks; the answers carry what each rank's
     executor published: the progress of its requests that ran or changed status, and the
     finished ones.
The driver holds no request records: only which rank has each request. What the ranks publish
goes to the engine unchanged (``ExecutorStep``), which applies it to the callers' handles.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

from batchgen_data.config import EngineConfig
from batchgen_data.engine.core.progress import RequestProgress
from batchgen_data.engine.core.request import NewRequest
from batchgen_data.engine.core.sequence import SequenceState, SequenceStatus
from batchgen_data.engine.executor.base import ExecutorStep
from batchgen_data.engine.executor.comm_time import split_comm_time
from batchgen_data.engine.executor.rank_backend import start_rank_group
from batchgen_data.engine.executor.rank_protocol import RankCommand, RankLoad, StepResult
from batchgen_data.engine.migration.costs import RANK_TRANSFER_BYTES_PER_S, MigrationCosts
from batchgen_data.engine.stats import EngineStats, RankStats
from batchgen_data.engine.step_report import StepReport
from batchgen_data.errors import BatchGenError, ConfigError
from batchgen_data.model.config import ModelConfig
from batchgen_data.model.moe.store import ExpertShard
from batchgen_data.rebalance.core.move_rule import plan_moves
from batchgen_data.rebalance.core.progress import SeqProgress, WorkerProgress
from batchgen_data.rebalance.core.replay import finish_s
from batchgen_data.rebalance.core.step_model import StepModel

# A sequence moves between ranks at most this often (bounds ping-pong at the tail).
_MAX_RANK_MOVES = 2


class ExpertParallelExecutor:
    """``config.expert_parallel_size`` ranks in lockstep, local processes or Ray actors
    (``rank_backend.py``; see the module NOTE)."""

    def __init__(self, model_path: str | os.PathLike, config: EngineConfig, model_config: ModelConfig,
                 clock: Callable[[], float]):
        world = config.expert_parallel_size
        if not model_config.sparse_layer_ids:
            raise ConfigError("expert_parallel_size > 1 needs a model with MoE layers")
        ExpertShard(0, world).owned(model_config.num_experts)  # ConfigError unless N divides E
        self.config = config
        self._clock = clock
        self.group = start_rank_group(model_path, config, world)
        first = self.group.ready[0]
        self._num_kv_blocks, self._block_size = first.num_kv_blocks, first.block_size  # what a request must fit
        self._kv_bytes_per_token = first.kv_bytes_per_token
        self._unplaced: list[NewRequest] = []
        self._live: set[int] = set()  # request ids added or imported and not finished or exported
        self._rank_of: dict[int, int] = {}
        self._moves: dict[int, int] = {}
        # The last progress published for each request placed on a rank (what the move rule
        # reads at the tail); entries of requests no longer on a rank are dropped there.
        self._published: dict[int, RequestProgress] = {}
        self._inbound: list[list[SequenceState]] = [[] for _ in range(world)]
        self._loads = [RankLoad(0, 0, 0, config.max_num_seqs) for _ in range(world)]
        self._rank_stats: list[RankStats] = []
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

    def add(self, request: NewRequest) -> None:
        self._unplaced.append(request)
        self._live.add(request.request_id)

    def step(self) -> ExecutorStep:
        """One lockstep forward on every rank; what they published."""
        commands = [RankCommand(imports=inbound) for inbound in self._inbound]
        self._inbound = [[] for _ in commands]
        self._place(commands)
        targets = self._plan_tail(commands)
        results = self.group.step(commands)
        finished = [done for result in results for done in result.finished]
        self._published.update((p.request_id, p) for result in results for p in result.progress)
        for done in finished:
            self._live.discard(done.request_id)
            self._rank_of.pop(done.request_id, None)
            self._moves.pop(done.request_id, None)
        for giver, receiver in targets.items():
            for state in results[giver].exported:
                self._rank_of[state.request_id] = receiver
                self._moves[state.request_id] = self._moves.get(state.request_id, 0) + 1
                self._inbound[receiver].append(state)
        self._loads = [r.load for r in results]
        self._rank_stats = [r.stats for r in results]
        self._num_steps += 1
        return ExecutorStep([p for result in results for p in result.progress], finished, self._report(results))

    def _place(self, commands: list[RankCommand]) -> None:
        """New requests to the rank with the fewest tokens left (what it reported, plus what it
        is given now)."""
        tokens_left = [load.tokens_left for load in self._loads]
        for request in self._unplaced:
            rank = min(range(len(commands)), key=lambda r: (tokens_left[r], r))
            commands[rank].add.append(request)
            # A pooling row generates nothing; it counts as one step's token so such rows spread.
            tokens_left[rank] += max(1, request.params.max_tokens)
            self._rank_of[request.request_id] = rank
            self._published[request.request_id] = RequestProgress.of_new(request)
        self._unplaced = []

    def _plan_tail(self, commands: list[RankCommand]) -> dict[int, int]:
        """MIGRATE between ranks (giver -> receiver) by the engine's one move rule
        (``migration/planner.py``), from what the ranks published up to the last step: the
        chosen requests go into the giver's ``export_ids``. Ranks step in lockstep, so a step
        lasts as long as the slowest rank and the all-to-alls whatever one rank runs: the plan
        uses a flat step model at the measured step, under which queued work moves to free
        slots where that starts it clearly sooner, and running sets stay where they are."""
        if any(c.add or c.imports for c in commands) or not self._rank_stats:
            return {}
        if all(load.num_running + load.num_queued >= self.config.max_num_seqs for load in self._loads):
            return {}  # no rank has a slot to take anything
        step_s = max(r.busy_s / r.num_forwards if r.num_forwards else 0.0 for r in self._rank_stats)
        if step_s <= 0.0:
            return {}
        for rid in [rid for rid in self._published if rid not in self._rank_of]:
            del self._published[rid]  # finished or exported
        ranks = [self._rank_progress(rank, step_s) for rank in range(len(commands))]
        model, targets, busy = StepModel(step_s, 0.0), {}, set()
        for giver in sorted(range(len(ranks)), key=lambda r: -finish_s(
                [p.num_tokens_left for p in ranks[r].seqs], ranks[r].run_slots, model)):
            receivers = [r for r in range(len(ranks)) if r != giver and r not in busy]
            if giver in busy or not receivers:
                continue
            plan = plan_moves(ranks[giver], [ranks[r] for r in receivers], None, model)
            if not plan.moves:
                continue
            first = plan.moves[0].receiver  # one receiver per giver and step: the one served first
            moves = [m for m in plan.moves if m.receiver == first]
            # One rank's rates decide for all its started sequences alike (``WorkerProgress.ships_kv``).
            commands[giver].export_ids = [m.request_id for m in moves]
            commands[giver].export_with_kv = any(m.send_kv for m in moves)
            targets[giver] = receivers[first]
            busy |= {giver, receivers[first]}
        return targets

    def _rank_progress(self, rank: int, step_s: float) -> WorkerProgress:
        """One rank as the move rule sees it: its requests (running, then suspended, then
        waiting in arrival order), its slots, and what a move costs (one lockstep step, plus the
        tokens' KV shipped between ranks or recomputed, at that rank's measured rates)."""
        seqs = [SeqProgress(p.num_generated, p.max_tokens, p.num_tokens,
                            started=p.status in (SequenceStatus.RUNNING, SequenceStatus.SUSPENDED),
                            movable=self._moves.get(rid, 0) < _MAX_RANK_MOVES,
                            running=p.status is SequenceStatus.RUNNING, request_id=rid)
                for rid, p in self._published.items() if self._rank_of.get(rid) == rank]
        seqs.sort(key=lambda s: (not s.running, not s.started, s.request_id))
        costs = MigrationCosts.of_stats(self._rank_stats[rank], self._kv_bytes_per_token,
                                        RANK_TRANSFER_BYTES_PER_S, latency_s=step_s)
        return WorkerProgress(self.config.max_num_seqs, tuple(seqs), move_s_per_token=costs.move_s_per_token(),
                              move_latency_s=step_s, kv_s_per_token=costs.transfer_s(1))

    def _report(self, results: list[StepResult]) -> StepReport:
        extras = {}
        if self.config.collect_timeline:
            extras = {"rank_tokens": [r.num_tokens for r in results], "rank_step_s": [r.step_s for r in results],
                      "rank_comm_s": [r.comm_s for r in results], **split_comm_time([r.comm_spans for r in results])}
        return StepReport(num_running=sum(r.load.num_running for r in results),
                          num_queued=sum(r.load.num_queued for r in results) + len(self._unplaced),
                          num_tokens=sum(r.num_tokens for r in results),
                          num_sampled=sum(r.num_sampled for r in results), extras=extras)

    # -- MIGRATE across engines --------------------------------------------------------------------

    def export(self, request_id: int, with_kv: bool = False) -> SequenceState:
        if request_id not in self._live:
            raise BatchGenError(f"request {request_id} is not waiting, suspended or running here; "
                                "only those can be exported")
        unplaced = next((r for r in self._unplaced if r.request_id == request_id), None)
        if unplaced is not None:
            self._unplaced.remove(unplaced)
            state = SequenceState(request_id, list(unplaced.prompt_token_ids), [], unplaced.params, unplaced.seed)
        else:
            rank = self._rank_of[request_id]
            inbound = next((s for s in self._inbound[rank] if s.request_id == request_id), None)
            if inbound is not None:  # between ranks right now: hand on the state it travels with
                self._inbound[rank].remove(inbound)
                state = inbound
            else:
                commands = [RankCommand(step=False) for _ in range(self.config.expert_parallel_size)]
                commands[rank].export_ids, commands[rank].export_with_kv = [request_id], with_kv
                state = self.group.step(commands)[rank].exported[0]
        self._live.discard(request_id)
        self._rank_of.pop(request_id, None)
        return state

    def import_state(self, state: SequenceState, request_id: int) -> RequestProgress:
        """Continue ``state`` as request ``request_id``, on the rank with the fewest tokens left.
        Its progress until that rank publishes (after its next step): queued as a scheduler
        queues an import (waiting if it has generated nothing, else suspended)."""
        state = dataclasses.replace(state, request_id=request_id)
        rank = min(range(len(self._loads)), key=lambda r: (self._loads[r].tokens_left, r))
        self._inbound[rank].append(state)
        self._rank_of[request_id] = rank
        self._live.add(request_id)
        num_generated = len(state.output_token_ids)
        status = SequenceStatus.SUSPENDED if num_generated else SequenceStatus.WAITING
        return RequestProgress(request_id, status, num_generated, state.params.max_tokens,
                               len(state.prompt_token_ids) + num_generated)

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
            num_draft_tokens=sum(r.num_draft_tokens for r in ranks),
            num_accepted_tokens=sum(r.num_accepted_tokens for r in ranks),
        )

    def close(self) -> None:
        """Stop the rank processes."""
        self.group.close()
