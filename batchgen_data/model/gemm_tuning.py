"""Measured GEMM kernel choice on CPU: per weight shape and row count, the fastest kernel.

Which fp32 GEMM is fastest for ``x [M, K] @ w[N, K].T`` depends on the CPU, its caches and the
thread count as much as on the shapes: on this project's AMD EPYC (AVX2) machines oneDNN wins for
wide weights and single rows, while on an Intel Xeon (AVX-512) machine ``F.linear`` streamed the
weights 1.1-1.6x faster than oneDNN with one or two rows. So the engine measures instead of
guessing (as cuBLASLt heuristics or inductor's autotuning do on GPUs).

NOTE: the measurement. For each row bucket (1, 2-3, 4-7, ... rows) and each kernel, one pass runs
the kernel over the model's weights of every shape that bucket concerns, timing the calls. With
few rows a GEMM is bound by reading its weight from memory, so the pass streams 64 MiB of each
shape's weights as a decode step does, copying a shape's weights where the model has fewer (a
hot-cache microbenchmark of one weight can favour a kernel that is slower in place); with many
rows it is compute bound and one weight per shape suffices. The best of three passes counts,
and each call's output is made row-major as its consumers need. The plan is cached per machine,
torch version, thread count and shape set, so a process tunes once (~2-4 s for a 200 M-parameter
model) and later ones load it. A plan records how loaded the machine was while it was measured;
one measured under load is measured again, and replaced, by the first process that finds the
machine quiet (``load_or_tune``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from batchgen_data.hardware import cpu_model
from batchgen_data.paths import write_cache_file

logger = logging.getLogger(__name__)

Shape = tuple[int, int]  # (N out features, K in features) of a weight
Kernel = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _onednn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def _weight_left(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.mm(w, x.t()).t()  # [M, N] view of the row-major [N, M] product


def available_kernels(native: bool = False) -> dict[str, Kernel]:
    """The CPU GEMM kernels ``linear`` may dispatch to; each returns x @ w.T as [M, N]. With
    ``native``, also the project's compiled skinny GEMM (``model/native``), where it builds."""
    kernels: dict[str, Kernel] = {"linear": F.linear, "weight_left": _weight_left}
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        kernels["onednn"] = _onednn
    if native:
        from batchgen_data.model.native import load_native

        module = load_native()
        if module is not None:
            kernels["skinny"] = module.skinny_linear
    return kernels


# Kernels made for few rows only: the tuner does not try them beyond this many.
KERNEL_MAX_ROWS = {"skinny": 32}


# Row buckets: bucket i holds 2**i .. 2**(i+1)-1 rows and is measured at its geometric middle.
NUM_BUCKETS = 11  # up to 1024+ rows; larger row counts use the last bucket's choice
_MEMORY_BOUND_ROWS = 32  # up to here a pass streams weights of a shape, above it takes one
_STREAM_BYTES = 64 * 2**20  # weights streamed per shape and pass: more than a CPU's L2 and L3 slice
_MAX_STREAMED = 16  # calls per shape and pass at most (copies of a small weight included)
_TUNER_VERSION = 2  # in the plan cache key: plans measured by an older tuner are measured again
_MAX_MEASURED_ROWS = 1024
# Load per CPU (1-minute average) above which a tuning counts as done under load, and at or
# below which a process tunes such a plan again (``load_or_tune``).
_LOADED = 0.75
_QUIET = 0.6
_PASSES = 3


def bucket_of(rows: int) -> int:
    return min(NUM_BUCKETS - 1, max(rows, 1).bit_length() - 1)


def bucket_rows(bucket: int) -> int:
    return min(_MAX_MEASURED_ROWS, round(2**bucket * 1.41)) if bucket else 1


@dataclass(slots=True)
class GemmPlan:
    """Kernel name per row bucket, for each weight shape it was tuned on, and how loaded the
    machine was then (``load_per_cpu``: the 1-minute load average over the CPU count; None when
    not known, as in plans cached before it was recorded)."""

    choices: dict[Shape, list[str]] = field(default_factory=dict)
    load_per_cpu: float | None = field(default=None, compare=False)

    def kernel_for(self, rows: int, n: int, k: int) -> str | None:
        names = self.choices.get((n, k))
        return names[min(bucket_of(rows), len(names) - 1)] if names else None

    def to_json(self) -> str:
        return json.dumps({"choices": {f"{n}x{k}": names for (n, k), names in self.choices.items()},
                           "load_per_cpu": self.load_per_cpu})

    @classmethod
    def from_json(cls, text: str) -> GemmPlan:
        data = json.loads(text)
        choices, load = (data["choices"], data.get("load_per_cpu")) if "choices" in data else (data, None)
        return cls({tuple(int(v) for v in key.split("x")): list(names) for key, names in choices.items()}, load)

    def tuned_under_load(self) -> bool:
        """Measured while other work held the CPUs (or when, unknown): a multi-threaded kernel
        then loses more than a single-threaded one, and the choice can be wrong for a quiet
        machine (a plan tuned during a test run picked a 1-row lm_head kernel 3x slower:
        10.4 ms against oneDNN's 3.4 ms on the demo model, 2 threads, AMD EPYC)."""
        return self.load_per_cpu is None or self.load_per_cpu > _LOADED


Timer = Callable[[Kernel, torch.Tensor, list[torch.Tensor]], float]


def time_pass(kernel: Kernel, x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    """Seconds per call of ``kernel(x, w)`` over the weights, in turn, with the output made
    row-major as its consumers need it (weight-left returns a transposed view)."""
    start = time.perf_counter()
    for w in weights:
        kernel(x, w).contiguous()
    return (time.perf_counter() - start) / len(weights)


def tune(weights: dict[Shape, list[torch.Tensor]], max_rows: dict[Shape, int],
         kernels: dict[str, Kernel] | None = None, timer: Timer = time_pass) -> GemmPlan:
    """The fastest kernel per shape and row bucket up to ``max_rows[shape]``."""
    kernels = kernels or available_kernels()
    plan = GemmPlan()
    streamed_weights: dict[Shape, list[torch.Tensor]] = {}  # copies made once, for every few-rows bucket
    for bucket in range(NUM_BUCKETS):
        rows = bucket_rows(bucket)
        shapes = [s for s in weights if bucket <= bucket_of(max_rows[s])]
        if not shapes:
            break
        best: dict[Shape, dict[str, float]] = {s: {} for s in shapes}
        if rows <= _MEMORY_BOUND_ROWS:
            streamed = {s: streamed_weights.setdefault(s, _streamed(weights[s])) for s in shapes}
        else:
            streamed = {s: weights[s][:1] for s in shapes}
        inputs = {s: torch.randn(rows, s[1], dtype=weights[s][0].dtype) for s in shapes}
        candidates = {name: k for name, k in kernels.items() if rows <= KERNEL_MAX_ROWS.get(name, rows)}
        for kernel in candidates.values():
            for shape in shapes:
                kernel(inputs[shape], weights[shape][0])  # warm-up: allocator, oneDNN primitive cache
        for _ in range(_PASSES):
            for name, kernel in candidates.items():
                for shape in shapes:
                    t = timer(kernel, inputs[shape], streamed[shape])
                    best[shape][name] = min(t, best[shape].get(name, float("inf")))
        for shape in shapes:
            plan.choices.setdefault(shape, []).append(min(best[shape], key=best[shape].get))
    return plan


def _streamed(ws: list[torch.Tensor]) -> list[torch.Tensor]:
    """About ``_STREAM_BYTES`` of distinct weights of one shape: the model's own, then copies of
    them where it has too few (an lm_head is one weight: timed alone, each pass is one call, on a
    weight the pass before may have left in cache), at most ``_MAX_STREAMED`` calls a pass."""
    wanted = max(1, min(_MAX_STREAMED, -(-_STREAM_BYTES // (ws[0].numel() * ws[0].element_size()))))
    out = list(ws[:wanted])
    while len(out) < wanted:
        out.append(ws[len(out) % len(ws)].clone())
    return out


def plan_cache_key(weights: dict[Shape, list[torch.Tensor]], max_rows: dict[Shape, int],
                   kernel_names: list[str] | None = None) -> str:
    parts = [_TUNER_VERSION, platform.machine(), platform.processor(), cpu_model(), torch.__version__,
             str(torch.get_num_threads()),
             sorted((s, len(ws), str(ws[0].dtype), bucket_of(max_rows[s])) for s, ws in weights.items())]
    if kernel_names is not None:  # a plan chooses among these: another set is another plan
        parts.append(sorted(kernel_names))
    return hashlib.sha1(repr(parts).encode()).hexdigest()[:16]


def load_per_cpu() -> float | None:
    """The 1-minute load average over the CPU count; None where the OS does not say."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except (OSError, AttributeError):
        return None


def load_or_tune(weights: dict[Shape, list[torch.Tensor]], max_rows: dict[Shape, int],
                 cache_folder: Path | None, kernels: dict[str, Kernel] | None = None) -> GemmPlan:
    """The cached plan for this machine and model, else a freshly tuned one (then cached), over
    ``kernels`` (default: torch's). A cached plan tuned under load is tuned again, and replaced,
    once a process finds the machine quiet (``GemmPlan.tuned_under_load``): a wrong choice does
    not stay cached for good."""
    names = None if kernels is None else list(kernels)
    path = None if cache_folder is None else cache_folder / f"{plan_cache_key(weights, max_rows, names)}.json"
    load = load_per_cpu()
    if path is not None and path.is_file():
        try:
            cached = GemmPlan.from_json(path.read_text())
            if not (cached.tuned_under_load() and load is not None and load <= _QUIET):
                return cached
        except (ValueError, KeyError, AttributeError, OSError) as err:
            logger.warning("ignoring unreadable GEMM plan %s: %s", path, err)
    start = time.perf_counter()
    plan = tune(weights, max_rows, kernels)
    plan.load_per_cpu = load
    logger.info("tuned CPU GEMM kernels for %d shapes in %.1f s", len(weights), time.perf_counter() - start)
    if path is not None:
        try:
            write_cache_file(path, plan.to_json())  # actors tuning at once do not corrupt it
        except OSError as err:
            logger.warning("could not cache the GEMM plan at %s: %s", path, err)
    return plan
