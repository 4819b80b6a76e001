"""Helpers for the fault tests: a skewed dataset, its reference outputs, and finding actor processes."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from batchgen_data import Engine, EngineConfig, SamplingParams

# One sequence at a time: MoE routing makes greedy output depend on batch composition when two
# experts' router logits tie to float precision (seen with the random demo weights: a 2.4e-7 gap
# flipped), and which rows share an engine is exactly what a fault changes. Alone, a row's
# result is the same on any actor, so the check below can demand the exact text.
ENGINE_CONFIG = {"max_num_seqs": 1, "attention_batch_size": 1, "max_num_batched_tokens": 512}


def fault_rows(n: int = 32) -> list[dict]:
    """Rows whose output lengths vary (so the job lasts a while and some actors straggle)."""
    return [
        {"id": i, "prompt": f"Row {i}: summarise order {i * 13}.",
         "sampling_params": {"max_tokens": 8 + 24 * (i % 4 == 0), "ignore_eos": True}}
        for i in range(n)
    ]


def reference_texts(demo_path, rows: list[dict]) -> dict[int, str]:
    """Engine outputs computed as the actors compute them: Ray gives fractional-CPU actors one
    thread, and the demo model's random weights have near-tied logits that a different GEMM
    reduction order (2 threads) can flip."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = Engine(demo_path, EngineConfig(**ENGINE_CONFIG))
        params = [SamplingParams(temperature=0.0, **r["sampling_params"]) for r in rows]
        outs = engine.generate([r["prompt"] for r in rows], params)
    finally:
        torch.set_num_threads(threads)
    return {r["id"]: o.text for r, o in zip(rows, outs)}


def operator_pids() -> list[int]:
    """PIDs of processes whose title is a BatchGenOperator map worker."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "MapBatches(BatchGenOperator)" in cmdline and "MapWorker" in cmdline:
            pids.append(int(proc.name))
    return pids


def run_in_thread(fn) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def target():
        try:
            box["result"] = fn()
        except BaseException as err:  # surfaced by the test
            box["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, box


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not predicate():
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def sigkill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def check_job_output(thread: threading.Thread, box: dict, rows: list[dict], expected: dict[int, str]) -> None:
    """The job finished despite the fault, with every row exactly once and its expected text."""
    thread.join(240)
    assert not thread.is_alive(), "the job did not finish after the fault"
    assert "error" not in box, box.get("error")
    out = box["result"]
    assert sorted(r["id"] for r in out) == [r["id"] for r in rows]  # every row exactly once
    assert {r["id"]: r["generated_text"] for r in out} == expected
    assert all(r["__inference_error__"] is None for r in out)
