"""A decode step's greedy tokens, and what their logprobs need, without the [N, V] logits.

NOTE: with 64 rows and a 152k vocabulary the logits are 39 MB. Written by the LM head's GEMM and
read again for the argmax (or the log sum exp of logprobs), they cost two passes through memory
that the rest of the step does not need: the GEMM alone took 34 ms against 25 ms for the same
GEMM a chunk at a time into a buffer that stays in cache (2-core Xeon, demo model, ad-hoc run).
So where every row of a step is greedy and nothing else reads its logits (no processor,
grammar, sampled row or draft), the GEMM runs ``CHUNK`` vocabulary columns at a time and the
native kernel (``logit_topk_stream``) takes each chunk's maximum, ties, top k and, for logprobs,
its sum of exponentials while the chunk is in cache. Each output is one dot product over the
hidden size either way, so a chunk's logits are bitwise the whole GEMM's (tested).

It applies where ``compute_logits`` would run a GEMM over more than ``fused_decode.MAX_TOKENS``
rows; fewer rows' logits fit in cache anyway and come from the native skinny GEMM. Whether it
pays depends on the BLAS: here the whole GEMM was 3-7% faster than the chunks for 33-48 rows
and 1.3-1.5x slower from 56 rows (MKL changes its algorithm in between; ad-hoc run). So
``HeadChoice`` measures: for each size bucket, the first steps alternate the two ways and the
faster one serves from then on. Tokens and logprobs are the same either way; only time differs.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch

from batchgen_data.model.fused_decode import MAX_TOKENS
from batchgen_data.model.native import active_native
from batchgen_data.model.native.kernels import LogitTopK

CHUNK = 8192  # vocabulary columns per GEMM: 64 rows of them are 2 MiB, one core's L2 here


def lm_head_topk(model, hidden: torch.Tensor, k: int, with_norm: bool) -> LogitTopK | None:
    """``LogitTopK`` of ``model.compute_logits(hidden)`` with each row's first maximum as its
    chosen token (``with_norm`` False: no log sum exp, for plain greedy rows), or None where
    this does not apply (few rows, no native kernels, not fp32 on CPU) or a row needs the full
    logits (a NaN or +inf, or only -inf)."""
    head = model.lm_head
    if (hidden.shape[0] <= MAX_TOKENS or hidden.dtype != torch.float32 or not hidden.is_cpu
            or head.dtype != torch.float32 or not head.is_contiguous() or k > head.shape[0]):
        return None
    native = active_native()
    if native is None:
        return None
    return native.lm_head_topk(model.final_norm(hidden).contiguous(), head, k, with_norm, CHUNK)


TRIALS = 2  # steps timed each way per bucket before one is chosen
BUCKET = 8  # rows: sizes within one bucket share a choice


@dataclass
class HeadChoice:
    """Chunked LM head or whole logits, per (row bucket, with_norm), chosen by timing real
    steps: ``chunked`` says which way the next step of that size goes, ``record`` takes its
    time (LM head to sampled tokens). ``enabled`` False: always the whole logits (an A/B's
    baseline, ``benchmarks/lm_head_ab.py``)."""

    enabled: bool = True
    times: dict[tuple[int, bool], dict[bool, list[float]]] = field(default_factory=dict)
    chosen: dict[tuple[int, bool], bool] = field(default_factory=dict)

    def chunked(self, rows: int, with_norm: bool) -> bool:
        if not self.enabled:
            return False
        key = (rows // BUCKET, with_norm)
        if key in self.chosen:
            return self.chosen[key]
        timed = self.times.setdefault(key, {True: [], False: []})
        return len(timed[True]) <= len(timed[False])  # alternate, chunked first

    def record(self, rows: int, with_norm: bool, chunked: bool, seconds: float) -> None:
        key = (rows // BUCKET, with_norm)
        if key in self.chosen:
            return
        timed = self.times.setdefault(key, {True: [], False: []})
        timed[chunked].append(seconds)
        if len(timed[True]) >= TRIALS and len(timed[False]) >= TRIALS:
            self.chosen[key] = statistics.median(timed[True]) <= statistics.median(timed[False])
