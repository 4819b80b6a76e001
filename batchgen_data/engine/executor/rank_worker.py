"""One expert-parallel rank: a process running an ``InProcessExecutor`` over its shard of the experts.

Started by ``rank_group.RankGroup`` as ``python -m batchgen_data.engine.executor.rank_worker --fd N``
with one end of a socket pair; it never imports the driver's ``__main__``. It joins the
process group (``deepspeed.init_distributed``; gloo on CPU, NCCL on CUDA), loads its experts,
then serves ``RankCommand`` s until told to shut down or its driver goes away (end of file on
the socket), and exits on any error after reporting it.

NOTE: the loop. Each command: MIGRATE out what was asked (between steps), add the new and
imported requests, run one executor step — a zero-token forward when this rank has nothing,
so the other ranks' all-to-alls never wait on it — and answer with what its executor published
(the progress of the requests imported, or that ran or changed status, and the finished ones),
the load and the counters. The rank keeps each live request's last published progress: what
its load and its MIGRATE choices read; the records stay in its scheduler.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection

from batchgen_data.engine.executor.in_process import InProcessExecutor
from batchgen_data.engine.executor.rank_protocol import (
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
from batchgen_data.engine.core.progress import RequestProgress
from batchgen_data.engine.core.sequence import EXPORTABLE, SequenceState
from batchgen_data.engine.stats import RankStats
from batchgen_data.engine.tokenizer import PromptTokenizer
from batchgen_data.model.config import ModelConfig


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
        self.control_group = _join_process_group(setup, config)
        if config.resolve_device().type == "cuda":
            index = setup.rank if setup.device_index is None else setup.device_index
            torch.cuda.set_device(index)
            config.device = f"cuda:{index}"
        self.rank = setup.rank
        self._start = time.perf_counter()
        model_config = ModelConfig.from_pretrained(setup.model_path)
        tokenizer = PromptTokenizer(setup.model_path, model_config.vocab_size, model_config.eos_token_ids)
        self.executor = InProcessExecutor(setup.model_path, config, self._now, tokenizer.eos_token_ids,
                                          tokenizer.decode, expert_shard=ExpertShard(setup.rank, setup.world_size))
        self.live: dict[int, RequestProgress] = {}  # request id -> its last published progress
        self.num_migrated_in = self.num_migrated_out = 0
        self.busy_s = 0.0
        import torch.distributed as dist

        dist.barrier(group=self.control_group)  # every rank loaded and reachable before any reports ready

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
        published: list[RequestProgress] = []
        for new in command.add:
            executor.add(new)
            self.live[new.request_id] = RequestProgress.of_new(new)
        for state in command.imports:
            progress = executor.import_state(state, state.request_id)
            self.live[state.request_id] = progress
            published.append(progress)
            self.num_migrated_in += 1
        model = executor.model
        comm0, tokens0 = model.expert_comm_seconds(), executor.runner.stats.num_tokens
        model.take_comm_spans()  # only this step's collectives
        start = time.perf_counter()
        out = executor.step() if command.step else None
        step_s = time.perf_counter() - start
        self.busy_s += step_s if command.step else 0.0
        if out is not None:
            published += out.progress
            self.live.update((p.request_id, p) for p in out.progress)
            for done in out.finished:
                del self.live[done.request_id]
        return StepResult(
            rank=self.rank,
            finished=[] if out is None else out.finished,
            progress=published,
            exported=exported,
            load=self._load(),
            stats=self._stats(),
            num_tokens=executor.runner.stats.num_tokens - tokens0,
            num_sampled=0 if out is None else out.report.num_sampled,
            step_s=step_s,
            comm_s=model.expert_comm_seconds() - comm0,
            comm_spans=model.take_comm_spans(),
        )

    def _export(self, command: RankCommand) -> list[SequenceState]:
        """MIGRATE out exactly the ids asked for (the driver's plan: ``migration/planner.py``),
        with their KV when ``export_with_kv``; one that finished meanwhile stays finished."""
        states = []
        for rid in command.export_ids:
            progress = self.live.get(rid)
            if progress is not None and progress.status in EXPORTABLE:
                states.append(self.executor.export(rid, with_kv=command.export_with_kv))
                del self.live[rid]
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
            num_draft_tokens=stats.num_draft_tokens,
            num_accepted_tokens=stats.num_accepted_tokens,
        )


def _join_process_group(setup: RankSetup, config):
    """``deepspeed.init_distributed`` at rank 0's address (the loopback for local ranks, its
    node's IP for Ray-placed ones), with the collective timeout; returns the gloo group for
    control messages (the default group on CPU, a gloo group beside NCCL on CUDA).

    Every rank calls this, and later builds DeepSpeed's expert-parallel groups, in the same
    order: ``torch.distributed`` matches groups by the order of their creation."""
    local = setup.rank if setup.device_index is None else setup.device_index
    os.environ.update(MASTER_ADDR=setup.master_addr, MASTER_PORT=str(setup.master_port), RANK=str(setup.rank),
                      LOCAL_RANK=str(local), WORLD_SIZE=str(setup.world_size))
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import logger as deepspeed_logger

    deepspeed_logger.setLevel(logging.WARNING)
    backend = "nccl" if config.resolve_device().type == "cuda" else "gloo"
    timeout = timedelta(seconds=config.rank_timeout_s)
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, timeout=timeout)
    return dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else None


if __name__ == "__main__":
    sys.exit(main())
