"""Latency of gloo collectives between two CPU processes on this node: what each MoE layer's
three collectives cost under expert parallelism, without the model.

    .venv/bin/python benchmarks/gloo_latency.py          # ~20 s

Two spawned processes (one thread each, unbound) time ``all_to_all_single`` over a range of
per-rank buffer sizes, the same with one rank arriving 2 ms late (the other waits, as in a
lockstep step), and an all-gather of 8 int64 counts.
"""

from __future__ import annotations

import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES_KB = (0.06, 4, 32, 256, 1024, 4096)


def _timed(fn, repeats: int) -> float:
    for _ in range(5):
        fn()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def _worker(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for kb in SIZES_KB:
            x = torch.randn(max(world, int(kb * 1024 / 4) // world * world))
            y = torch.empty_like(x)
            seconds = _timed(lambda: dist.all_to_all_single(y, x), 100)
            if rank == 0:
                print(f"all_to_all_single {kb:8.2f} KiB per rank: {seconds * 1e3:6.3f} ms", flush=True)
        x = torch.randn(8 * 768)
        y = torch.empty_like(x)
        busy = torch.randn(256, 256)

        def late_rank_0() -> None:
            if rank == 0:
                start = time.perf_counter()
                while time.perf_counter() - start < 0.002:
                    busy @ busy
            dist.all_to_all_single(y, x)

        seconds = _timed(late_rank_0, 100)
        if rank == 0:
            print(f"all_to_all_single 24 KiB, rank 0 arriving 2 ms late: {(seconds - 0.002) * 1e3:6.3f} ms beyond the 2 ms",
                  flush=True)
        counts = torch.zeros(8, dtype=torch.int64)
        gathered = torch.zeros(8 * world, dtype=torch.int64)
        seconds = _timed(lambda: dist.all_gather_into_tensor(gathered, counts), 200)
        if rank == 0:
            print(f"all_gather_into_tensor 8 int64: {seconds * 1e3:6.3f} ms", flush=True)
        seconds = _timed(lambda: dist.all_to_all_single(gathered, counts.repeat(world)), 200)
        if rank == 0:
            print(f"all_to_all_single 8 int64 to every rank: {seconds * 1e3:6.3f} ms", flush=True)
    finally:
        dist.destroy_process_group()


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(2, port), nprocs=2)


if __name__ == "__main__":
    main()
