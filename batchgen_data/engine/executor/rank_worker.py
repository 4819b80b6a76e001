"""One expert-parallel rank: a process running an ``InProcessExecutor`` over its shard of the experts.

Started by ``rank_group.RankGroup`` as ``python -m batchgen_data.engine.executor.rank_worker --fd N``
with one end of a socket pair; it never imports the driver's ``__main__``. It joins the
process group (``deepspeed.init_distributed``; gloo on CPU, NCCL on CUDA), loads its experts,
then serves ``RankCommand`` s until told to shut down or its driver goes away (end of file on
the socket), and exits on any error after reporting it.

NOTE: the loop. Each command: MIGRATE out what was asked (between steps), add the new and
imported sequences, run one executor step — a zero-token forward when this rank has nothing,
so the other ranks' all-to-alls never wait on it — and answer with the finished sequences, the
first tokens, the load and the counters.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection

from batchgen_data.engine.executor.in_process import InProcessExecutor
from batchgen_data.engine.executor.rank_protocol import (
    FinishedSequence,
    RankCommand,
    RankFailure,
    RankLoad,
    RankReady,
    RankSetup,
    StepResult,
    recv,
    send,
)
from batchgen_data.engine.executor.rank_resources import peak_rss_bytes, pin_to_cpus
from batchgen_data.engine.migration.costs import MigrationCosts, pick_to_move
from batchgen_data.engine.core.sequence import EXPORTABLE, Sequence, SequenceState
from batchgen_data.engine.stats import RankStats
from batchgen_data.engine.tokenizer import PromptTokenizer
from batchgen_data.model.config import ModelConfig

# Moving a sequence between ranks of one node: a pickled copy through a local socket.
_RANK_TRANSFER_BYTES_PER_S = 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="an expert-parallel rank (started by the engine)")
    parser.add_argument("--fd", type=int, required=True, help="this rank's end of the socket pair")
    conn = Connection(parser.parse_args(argv).fd)
    rank = -1
    try:
        setup: RankSetup = recv(conn)
        rank = setup.rank
        worker = RankWorker(setup)
        send(conn, worker.ready())
        worker.serve(conn)
        return 0
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return 0  # the driver is gone: nothing to report to
    except BaseException:  # report, then exit: the driver fails every waiter and stops the group
        try:
            send(conn, RankFailure(rank, traceback.format_exc()))
        except OSError:
            pass
        return 1


class RankWorker:
    """One rank: an ``InProcessExecutor`` over this rank's shard of the experts, commanded by
    the driver's ``ExpertParallelExecutor``."""

    def __init__(self, setup: RankSetup):
        import torch

        from batchgen_data.config import EngineConfig
        from batchgen_data.model.moe.store import ExpertShard

        torch.set_num_threads(setup.num_threads)
        config = EngineConfig(**setup.config)
        if config.bind_rank_cpus and config.resolve_device().type == "cpu":
            pin_to_cpus(setup.rank, setup.num_threads)
        _join_process_group(setup, config)
        if config.resolve_device().type == "cuda":
            torch.cuda.set_device(setup.rank)
            config.device = f"cuda:{setup.rank}"
        self.rank = setup.rank
        self._start = time.perf_counter()
        model_config = ModelConfig.from_pretrained(setup.model_path)
        tokenizer = PromptTokenizer(setup.model_path, model_config.vocab_size, model_config.eos_token_ids)
        self.executor = InProcessExecutor(setup.model_path, config, self._now, tokenizer.eos_token_ids,
                                          tokenizer.decode, expert_shard=ExpertShard(setup.rank, setup.world_size))
        self.live: dict[int, Sequence] = {}
        self.num_migrated_in = self.num_migrated_out = 0
        self.busy_s = 0.0

    def _now(self) -> float:
        return time.perf_counter() - self._start

    def ready(self) -> RankReady:
        executor = self.executor
        store = executor.model.expert_store
        sparse = store.layer_ids()
        return RankReady(self.rank, executor.num_kv_blocks, executor.block_size, executor.kv_bytes_per_token,
                         store.nbytes, store.owned(sparse[0]) if sparse else ())

    def serve(self, conn: Connection) -> None:
        while True:
            command: RankCommand = recv(conn)
            if command.shutdown:
                return
            send(conn, self.run(command))

    def run(self, command: RankCommand) -> StepResult:
        executor = self.executor
        exported = self._export(command)
        for new in command.add:
            seq = Sequence(new.request_id, list(new.prompt_token_ids), new.params, new.seed, arrival_s=self._now())
            self.live[seq.request_id] = seq
            executor.add(seq)
        for state in command.imports:
            self.live[state.request_id] = executor.import_state(state, state.request_id)
            self.num_migrated_in += 1
        before = {rid for rid, seq in self.live.items() if seq.num_generated == 0}
        model = executor.model
        comm0, tokens0 = model.expert_comm_seconds(), executor.runner.stats.num_tokens
        model.take_comm_spans()  # only this step's collectives
        start = time.perf_counter()
        finished = executor.step() if command.step else []
        step_s = time.perf_counter() - start
        self.busy_s += step_s if command.step else 0.0
        for seq in finished:
            del self.live[seq.request_id]
        started = [rid for rid in before if rid in self.live and self.live[rid].num_generated > 0]
        started += [s.request_id for s in finished if s.request_id in before and s.num_generated > 0]
        return StepResult(
            rank=self.rank,
            finished=[FinishedSequence(s.request_id, list(s.output_token_ids), s.finish_reason or "error", s.error,
                                       s.stop_text_len, s.num_cached_tokens, s.logprobs, s.prompt_logprobs)
                      for s in finished],
            started=started,
            exported=exported,
            load=self._load(),
            stats=self._stats(),
            num_tokens=executor.runner.stats.num_tokens - tokens0,
            step_s=step_s,
            comm_s=model.expert_comm_seconds() - comm0,
            comm_spans=model.take_comm_spans(),
        )

    def _export(self, command: RankCommand) -> list[SequenceState]:
        """MIGRATE out: the ids asked for, then up to ``export_count`` sequences picked by the
        same rule as across actors (``pick_to_move`` with ``MigrationCosts``)."""
        executor = self.executor
        states = []
        for rid in command.export_ids:
            seq = self.live.get(rid)
            if seq is not None and seq.status in EXPORTABLE:
                states.append(executor.export(seq, with_kv=command.export_with_kv))
                del self.live[rid]
        if command.export_count > 0:
            stats = dataclasses.replace(executor.stats(), busy_s=self.busy_s)
            step_s = stats.busy_s / stats.num_forwards if stats.num_forwards else 0.0
            costs = MigrationCosts.of_stats(stats, executor.kv_bytes_per_token, _RANK_TRANSFER_BYTES_PER_S,
                                            latency_s=step_s)
            for seq in pick_to_move(list(self.live.values()), command.export_count, costs):
                states.append(executor.export(seq, with_kv=costs.send_kv(seq.num_computed_tokens)))
                del self.live[seq.request_id]
        self.num_migrated_out += len(states)
        return states

    def _load(self) -> RankLoad:
        scheduler = self.executor.scheduler
        return RankLoad(scheduler.num_running, scheduler.num_queued,
                        sum(s.num_tokens_left for s in self.live.values()),
                        max(0, self.executor.max_running_seqs - scheduler.num_running))

    def _stats(self) -> RankStats:
        stats = self.executor.stats()
        runner = self.executor.runner.stats
        return RankStats(
            rank=self.rank,
            num_generated_tokens=stats.num_generated_tokens,
            num_forward_tokens=stats.num_forward_tokens,
            num_forwards=stats.num_forwards,
            num_idle_forwards=stats.num_idle_forwards,
            busy_s=self.busy_s,
            kernel_s=stats.kernel_s,
            expert_comm_s=stats.expert_comm_s,
            expert_weight_bytes=stats.expert_weight_bytes,
            peak_rss_bytes=peak_rss_bytes(),
            num_suspended=stats.num_suspended,
            num_resumed_swap=stats.num_resumed_swap,
            num_resumed_recompute=stats.num_resumed_recompute,
            num_recomputed_tokens=stats.num_recomputed_tokens,
            prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits,
            expert_calls=runner.expert_calls,
            expert_tokens=runner.expert_tokens,
            num_migrated_in=self.num_migrated_in,
            num_migrated_out=self.num_migrated_out,
        )


def _join_process_group(setup: RankSetup, config) -> None:
    """``deepspeed.init_distributed`` over this node's loopback, with the collective timeout."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(setup.master_port), RANK=str(setup.rank),
                      LOCAL_RANK=str(setup.rank), WORLD_SIZE=str(setup.world_size))
    import deepspeed
    from deepspeed.utils import logger as deepspeed_logger

    deepspeed_logger.setLevel(logging.WARNING)
    backend = "nccl" if config.resolve_device().type == "cuda" else "gloo"
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False,
                               timeout=timedelta(seconds=config.rank_timeout_s))


if __name__ == "__main__":
    sys.exit(main())
