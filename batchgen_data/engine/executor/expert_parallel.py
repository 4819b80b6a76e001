"""The expert-parallel engine: the public ``Engine`` API over N rank processes (DP attention, EP MoE).

``Engine(model, EngineConfig(expert_parallel_size=N))`` returns this class. The calling process
tokenizes, validates and places requests and assembles outputs; each rank (``rank_worker.py``)
holds its E/N experts of every MoE layer and runs its own sequences — its own scheduler, KV pool
and sampler — and every MoE layer exchanges routed tokens with the other ranks by DeepSpeed-MoE
all-to-all.

NOTE: one ``step``.
  1. Place: new requests go to the rank with the fewest tokens left to generate (its unfinished
     budgets plus what this step already gave it).
  2. Even out the tail: once nothing new is waiting here, a rank with queued sequences gives its
     unstarted ones to a rank with free slots; a rank running two or more sequences more than an
     idle rank gives half the gap, the ones worth moving by the same cost rule as across actors
     (``MigrationCosts``: KV shipped or recomputed). What a rank exports this step is imported by
     its receiver next step.
  3. Lockstep: every rank gets one command and runs exactly one forward — zero tokens if it has
     nothing — so every all-to-all has all its ranks; the answers carry the finished sequences.
"""

from __future__ import annotations

import os
import random
import time

from batchgen_data.config import EngineConfig
from batchgen_data.distributed.rank_group import RankGroup
from batchgen_data.distributed.rank_protocol import NewSequence, RankCommand, RankLoad, StepResult
from batchgen_data.engine.block_manager import BlockManager
from batchgen_data.engine.engine import Engine
from batchgen_data.engine.sequence import Sequence, SequenceState, SequenceStatus
from batchgen_data.engine.stats import EngineStats, RankStats
from batchgen_data.engine.tokenizer import PromptTokenizer
from batchgen_data.errors import BatchGenError, ConfigError
from batchgen_data.model.config import ModelConfig
from batchgen_data.model.moe.store import ExpertShard
from batchgen_data.model.resolve import resolve_model

# A sequence moves between ranks at most this often (bounds ping-pong at the tail).
_MAX_RANK_MOVES = 2


class ExpertParallelEngine(Engine):
    """``Engine`` over ``config.expert_parallel_size`` rank processes; same public API.

    Call ``close()`` (or use it as a context manager) to stop the ranks; they also stop when
    this object is garbage-collected or this process exits.
    """

    def __init__(self, model: str | os.PathLike = "demo", config: EngineConfig | None = None):
        self.config = config or EngineConfig()
        world = self.config.expert_parallel_size
        self.model_path = resolve_model(model)
        mcfg = ModelConfig.from_pretrained(self.model_path)
        if not mcfg.sparse_layer_ids:
            raise ConfigError("expert_parallel_size > 1 needs a model with MoE layers")
        ExpertShard(0, world).owned(mcfg.num_experts)  # ConfigError unless N divides E
        self.tokenizer = PromptTokenizer(self.model_path, mcfg.vocab_size, mcfg.eos_token_ids)
        self.max_model_len = self.config.max_model_len or mcfg.max_position_embeddings
        if self.max_model_len > mcfg.max_position_embeddings:
            raise ConfigError(f"max_model_len {self.max_model_len} exceeds the checkpoint's "
                              f"max_position_embeddings {mcfg.max_position_embeddings}")
        self.group = RankGroup(self.model_path, self.config, world)
        first = self.group.ready[0]
        self.blocks = BlockManager(first.num_kv_blocks, first.block_size)  # one rank's pool: what a request must fit
        self._kv_bytes_per_token = first.kv_bytes_per_token
        self._rng = random.Random(self.config.seed)
        self._next_id = 0
        self._num_finished = self._num_generated = 0
        self._busy_s = 0.0
        self._start = time.perf_counter()
        self.start_wall = time.time()
        self.timeline: list[dict] = []
        self._unplaced: list[Sequence] = []
        self._live: dict[int, Sequence] = {}  # request id -> the caller's Sequence
        self._rank_of: dict[int, int] = {}
        self._moves: dict[int, int] = {}
        self._inbound: list[list[SequenceState]] = [[] for _ in range(world)]
        self._loads = [RankLoad(0, 0, 0, self.config.max_num_seqs) for _ in range(world)]
        self._rank_stats: list[RankStats] = []
        self._num_steps = 0

    # -- requests -------------------------------------------------------------------------------

    def _enqueue(self, seq: Sequence) -> None:
        self._unplaced.append(seq)
        self._live[seq.request_id] = seq

    def has_unfinished_requests(self) -> bool:
        return bool(self._live)

    @property
    def num_unfinished(self) -> int:
        return len(self._live)

    @property
    def kv_bytes_per_token(self) -> int:
        return self._kv_bytes_per_token

    @property
    def max_running_seqs(self) -> int:
        return self.config.max_num_seqs * self.config.expert_parallel_size

    # -- step -----------------------------------------------------------------------------------

    def step(self) -> list[Sequence]:
        """One lockstep forward on every rank; returns the sequences that finished in it."""
        t0 = time.perf_counter()
        commands = [RankCommand(imports=inbound) for inbound in self._inbound]
        self._inbound = [[] for _ in commands]
        self._place(commands)
        targets = self._plan_tail(commands)
        results = self.group.step(commands)
        now = self._now()
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
        self._num_steps += 1
        elapsed = time.perf_counter() - t0
        self._busy_s += elapsed
        if self.config.collect_timeline:
            self.timeline.append(self._timeline_entry(results, elapsed))
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
            if seq.first_token_s is None and seq.output_token_ids:
                seq.first_token_s = now
            seq.finish(done.finish_reason, now, error=done.error)
            self._num_finished += 1
            self._num_generated += len(seq.output_token_ids)
            finished.append(seq)
        return finished

    def _timeline_entry(self, results: list[StepResult], elapsed: float) -> dict:
        return {
            "t": self._now(),
            "step_s": elapsed,
            "num_running": sum(r.load.num_running for r in results),
            "num_waiting": sum(r.load.num_queued for r in results) + len(self._unplaced),
            "num_tokens": sum(r.num_tokens for r in results),
            "num_sampled": sum(len(r.finished) for r in results),
            "rank_tokens": [r.num_tokens for r in results],
            "rank_step_s": [r.step_s for r in results],
            "rank_comm_s": [r.comm_s for r in results],
            **split_comm_time([r.comm_spans for r in results]),
        }

    # -- MIGRATE across engines -----------------------------------------------------------------

    def export_sequence(self, seq: Sequence, with_kv: bool = False) -> SequenceState:
        if seq.request_id not in self._live:
            raise BatchGenError(f"only waiting, suspended or running sequences can be exported, not {seq.status.name}")
        state = None
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

    def import_sequence(self, state: SequenceState, request_id: int | None = None) -> Sequence:
        request_id, self._next_id = self._next_id, self._next_id + 1
        seq = Sequence(request_id, list(state.prompt_token_ids), state.params, state.seed, arrival_s=self._now())
        seq.output_token_ids = list(state.output_token_ids)
        state = SequenceState(request_id, state.prompt_token_ids, state.output_token_ids, state.params, state.seed, state.kv)
        rank = min(range(len(self._loads)), key=lambda r: (self._loads[r].tokens_left, r))
        self._inbound[rank].append(state)
        self._rank_of[request_id] = rank
        self._live[request_id] = seq
        return seq

    # -- stats and lifetime ---------------------------------------------------------------------

    def stats(self) -> EngineStats:
        ranks = self._rank_stats
        return EngineStats(
            num_requests=self._next_id,
            num_finished=self._num_finished,
            num_generated_tokens=self._num_generated,
            num_forwards=self._num_steps,
            num_forward_tokens=sum(r.num_forward_tokens for r in ranks),
            mean_tokens_per_expert_call=0.0,
            kernel_s=max((r.busy_s for r in ranks), default=0.0),
            busy_s=self._busy_s,
            num_suspended=sum(r.num_suspended for r in ranks),
            num_resumed_swap=0,
            num_resumed_recompute=0,
            num_recomputed_tokens=sum(r.num_recomputed_tokens for r in ranks),
            num_kv_blocks=self.blocks.num_blocks,
            num_idle_forwards=sum(r.num_idle_forwards for r in ranks),
            expert_comm_s=sum(r.expert_comm_s for r in ranks),
            expert_weight_bytes=max((r.expert_weight_bytes for r in ranks), default=0),
            ranks=list(ranks),
        )

    def close(self) -> None:
        self.group.close()


def split_comm_time(spans: list[list[tuple[float, float]]]) -> dict:
    """Splits each rank's time in one step's collectives into waiting and exchanging.

    ``spans[r]`` holds rank r's (arrived, left) for each collective of the step, in order; every
    rank joins the same collectives (lockstep). No data moves before the last rank arrives: until
    then a rank waits for the slowest one (load imbalance, not communication); from then until it
    leaves, it exchanges. Per rank, wait + exchange = its time in collectives. Returns
    ``rank_wait_s`` and ``rank_exchange_s``; empty when the spans do not line up.
    """
    if len(spans) < 2 or not spans[0] or any(len(s) != len(spans[0]) for s in spans):
        return {}
    waits, exchanges = [0.0] * len(spans), [0.0] * len(spans)
    for joined in zip(*spans):
        last_in = max(arrived for arrived, _ in joined)
        for r, (arrived, left) in enumerate(joined):
            waits[r] += last_in - arrived
            exchanges[r] += max(0.0, left - last_in)
    return {"rank_wait_s": waits, "rank_exchange_s": exchanges}
