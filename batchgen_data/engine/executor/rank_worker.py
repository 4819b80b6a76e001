"""One expert-parallel rank: a process running an ``Engine`` over its shard of the experts.

Started by ``rank_group.RankGroup`` as ``python -m batchgen_data.distributed.rank_worker --fd N``
with one end of a socket pair; it never imports the driver's ``__main__``. It joins the
process group (``deepspeed.init_distributed``; gloo on CPU, NCCL on CUDA), loads its experts,
then serves ``RankCommand`` s until told to shut down or its driver goes away (end of file on
the socket), and exits on any error after reporting it.

NOTE: the loop. Each command: MIGRATE out what was asked (between steps), add the new and
imported sequences, run one ``Engine.step`` — a zero-token forward when this rank has nothing,
so the other ranks' all-to-alls never wait on it — and answer with the finished sequences, the
first tokens, the load and the counters.
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import sys
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection

from batchgen_data.distributed.migration import MigrationCosts
from batchgen_data.distributed.rank_protocol import (
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
from batchgen_data.engine.engine import Engine
from batchgen_data.engine.sequence import Sequence, SequenceState, SequenceStatus
from batchgen_data.engine.stats import RankStats

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


def peak_rss_bytes() -> int:
    """This process's peak resident memory: ``VmHWM``, which starts afresh at exec (a spawned
    rank's ``ru_maxrss`` would carry its parent's peak across the exec); ``ru_maxrss`` without /proc."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def pin_to_cpus(rank: int, num_threads: int) -> tuple[int, ...]:
    """Binds rank ``rank`` to its own ``num_threads`` CPUs of those this process may use, when
    every rank's slice fits; returns them (empty: left unpinned).

    Unpinned, the ranks, their gloo threads and the driver share every core, and a rank woken
    from a collective waits to be scheduled: on 2 CPUs (``benchmarks/expert_parallel.py`` with
    and without ``--no-bind-rank-cpus``) pinning cut the ranks' exchange time from 15.4% of step
    time to 13.1%, and their whole time in collectives from 25.1% to 20.6%.
    """
    if not hasattr(os, "sched_getaffinity"):
        return ()
    cpus = sorted(os.sched_getaffinity(0))
    mine = tuple(cpus[rank * num_threads:(rank + 1) * num_threads])
    if len(mine) < num_threads:  # fewer CPUs than ranks x threads: let the OS place them
        return ()
    os.sched_setaffinity(0, mine)
    return mine


class RankWorker:
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
        self.engine = Engine(setup.model_path, config, expert_shard=ExpertShard(setup.rank, setup.world_size))
        self.live: dict[int, Sequence] = {}
        self.num_migrated_in = self.num_migrated_out = 0

    def ready(self) -> RankReady:
        engine = self.engine
        store = engine.model.expert_store
        sparse = store.layer_ids()
        return RankReady(self.rank, engine.blocks.num_blocks, engine.blocks.block_size, engine.kv_bytes_per_token,
                         store.nbytes, store.owned(sparse[0]) if sparse else ())

    def serve(self, conn: Connection) -> None:
        while True:
            command: RankCommand = recv(conn)
            if command.shutdown:
                return
            send(conn, self.run(command))

    def run(self, command: RankCommand) -> StepResult:
        engine = self.engine
        exported = self._export(command)
        for new in command.add:
            seq = Sequence(new.request_id, list(new.prompt_token_ids), new.params, new.seed, arrival_s=engine._now())
            self.live[seq.request_id] = seq
            engine.scheduler.add(seq)
        for state in command.imports:
            self.live[state.request_id] = engine.import_sequence(state, request_id=state.request_id)
            self.num_migrated_in += 1
        before = {rid for rid, seq in self.live.items() if seq.num_generated == 0}
        comm0, tokens0 = engine.model.expert_comm_seconds(), engine.runner.stats.num_tokens
        engine.model.take_comm_spans()  # only this step's collectives
        start = time.perf_counter()
        finished = engine.step() if command.step else []
        step_s = time.perf_counter() - start
        for seq in finished:
            del self.live[seq.request_id]
        started = [rid for rid in before if rid in self.live and self.live[rid].num_generated > 0]
        started += [s.request_id for s in finished if s.request_id in before and s.num_generated > 0]
        return StepResult(
            rank=self.rank,
            finished=[FinishedSequence(s.request_id, list(s.output_token_ids), s.finish_reason or "error", s.error,
                                       s.stop_text_len) for s in finished],
            started=started,
            exported=exported,
            load=self._load(),
            stats=self._stats(),
            num_tokens=engine.runner.stats.num_tokens - tokens0,
            step_s=step_s,
            comm_s=engine.model.expert_comm_seconds() - comm0,
            comm_spans=engine.model.take_comm_spans(),
        )

    def _export(self, command: RankCommand) -> list[SequenceState]:
        """MIGRATE out: the ids asked for, then up to ``export_count`` sequences — unstarted
        ones first (nothing to move but tokens), then running or suspended ones with the most
        tokens left among those worth moving (``MigrationCosts``, as across actors)."""
        engine = self.engine
        states = []
        for rid in command.export_ids:
            seq = self.live.get(rid)
            if seq is not None and seq.status in _EXPORTABLE:
                states.append(engine.export_sequence(seq, with_kv=command.export_with_kv))
                del self.live[rid]
        if command.export_count > 0:
            stats = engine.stats()
            step_s = stats.busy_s / stats.num_forwards if stats.num_forwards else 0.0
            costs = MigrationCosts.of_engine(engine, _RANK_TRANSFER_BYTES_PER_S, latency_s=step_s)
            waiting = [s for s in self.live.values() if s.status is SequenceStatus.WAITING]
            started = sorted((s for s in self.live.values() if s.status in (SequenceStatus.RUNNING, SequenceStatus.SUSPENDED)),
                             key=lambda s: -s.num_tokens_left)
            chosen = waiting[: command.export_count]
            chosen += [s for s in started if costs.worth_moving(s)][: command.export_count - len(chosen)]
            for seq in chosen:
                states.append(engine.export_sequence(seq, with_kv=costs.send_kv(seq.num_computed_tokens)))
                del self.live[seq.request_id]
        self.num_migrated_out += len(states)
        return states

    def _load(self) -> RankLoad:
        scheduler = self.engine.scheduler
        running = len(scheduler.running)
        return RankLoad(running, len(scheduler.waiting) + len(scheduler.suspended),
                        sum(s.num_tokens_left for s in self.live.values()),
                        max(0, self.engine.config.max_num_seqs - running))

    def _stats(self) -> RankStats:
        stats = self.engine.stats()
        return RankStats(
            rank=self.rank,
            num_generated_tokens=stats.num_generated_tokens,
            num_forward_tokens=stats.num_forward_tokens,
            num_forwards=stats.num_forwards,
            num_idle_forwards=stats.num_idle_forwards,
            busy_s=stats.busy_s,
            expert_comm_s=stats.expert_comm_s,
            expert_weight_bytes=stats.expert_weight_bytes,
            peak_rss_bytes=peak_rss_bytes(),
            num_suspended=stats.num_suspended,
            num_recomputed_tokens=stats.num_recomputed_tokens,
            num_migrated_in=self.num_migrated_in,
            num_migrated_out=self.num_migrated_out,
        )


_EXPORTABLE = (SequenceStatus.WAITING, SequenceStatus.RUNNING, SequenceStatus.SUSPENDED)


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
