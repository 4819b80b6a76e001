"""The engine's side of expert offloading: the running set planned with the fetch cost, and stats.

With ``EngineConfig.weight_memory_bytes`` the routed experts stream through a bounded pool
(``model/moe/streamed_store.py``). Every step must copy the experts its tokens pick that the pool
does not hold, and a copy costs the same whether 8 or 256 sequences' tokens share the expert, so
more sequences in flight amortise each fetch (the BatchGen paper's section 6.5, after MoE-Gen).

NOTE: the plan. At load the engine measures the fetch rate (the pool's first fill from the
checkpoint) and the expert GEMM rate by row count (``linear`` over the pool's rows), then models
one decode step of n sequences, each sparse layer alike:
    touched(n) = E * (1 - (1 - K/E)^n)          experts that get tokens, n*K/touched rows each
    compute(n) = n * dense FLOPs per token / rate(n) + L * touched * 6*H*F*rows / rate(rows)
    fetch(n)   = max(0, L * touched - slots) * bytes per expert / fetch rate
    step(n)    = max(compute(n), fetch(n))       the fetch thread overlaps compute
and runs the fewest sequences whose modelled throughput n / step(n) is within ``_PLAN_TOLERANCE``
of the best, up to ``max_num_seqs`` and half the KV pool's pages (a running sequence holds at
least one page and keeps one of headroom). Attention is left out: it does not touch experts.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from batchgen_data.model import MoEModel
from batchgen_data.model.layers import linear
from batchgen_data.model.moe.store import StreamedStore
from batchgen_data.model.moe.stream_stats import StreamStats

_PLAN_TOLERANCE = 0.02  # run fewer sequences only if that keeps this share of the best throughput
_GEMM_ROWS = (1, 4, 16, 64, 256)  # row counts the expert GEMM rate is measured at (flat beyond)
_GEMM_REPEATS = 3


@dataclass(frozen=True, slots=True)
class StepCostModel:
    """What one decode step costs as a function of the sequences in it (see the module NOTE)."""

    num_experts: int  # E
    top_k: int  # K
    num_sparse_layers: int  # L
    num_slots: int
    bytes_per_expert: int
    expert_flops_per_row: float  # 6 * H * F: gate, up and down for one token
    dense_flops_per_token: float  # attention projections, shared experts, dense layers, lm_head
    fetch_bytes_per_s: float
    gemm_flops_per_s: dict[int, float]  # measured rate by rows per GEMM

    def rate(self, rows: float) -> float:
        """GEMM FLOP/s at ``rows`` rows: interpolated in log(rows) between measured points."""
        points = sorted(self.gemm_flops_per_s.items())
        if rows <= points[0][0]:
            return points[0][1]
        for (r0, f0), (r1, f1) in zip(points, points[1:]):
            if rows <= r1:
                share = math.log(rows / r0) / math.log(r1 / r0)
                return f0 + share * (f1 - f0)
        return points[-1][1]

    def step_seconds(self, num_seqs: int) -> tuple[float, float]:
        """(compute, fetch) seconds of a decode step of ``num_seqs`` sequences."""
        touched = self.num_experts * (1.0 - (1.0 - self.top_k / self.num_experts) ** num_seqs)
        rows = num_seqs * self.top_k / touched
        compute = (num_seqs * self.dense_flops_per_token / self.rate(num_seqs)
                   + self.num_sparse_layers * touched * self.expert_flops_per_row * rows / self.rate(rows))
        fetched = max(0.0, self.num_sparse_layers * touched - self.num_slots)
        return compute, fetched * self.bytes_per_expert / self.fetch_bytes_per_s

    def tokens_per_s(self, num_seqs: int) -> float:
        return num_seqs / max(self.step_seconds(num_seqs))


@dataclass(frozen=True, slots=True)
class OffloadPlan:
    running_seqs: int  # the running-set size the scheduler fills to
    fetch_bytes_per_s: float  # measured at load
    predicted_tokens_per_s: float  # decode throughput the model predicts at ``running_seqs``
    predicted_fetch_share: float  # fetch seconds over step seconds at ``running_seqs`` (> 1: fetch-bound)


def plan_running_set(model: StepCostModel, max_seqs: int) -> OffloadPlan:
    """The fewest sequences (up to ``max_seqs``) within ``_PLAN_TOLERANCE`` of the best throughput."""
    candidates = sorted({min(2**i, max_seqs) for i in range(max_seqs.bit_length() + 1)} | {max_seqs})
    best = max(model.tokens_per_s(n) for n in candidates)
    chosen = next(n for n in candidates if model.tokens_per_s(n) >= (1.0 - _PLAN_TOLERANCE) * best)
    compute, fetch = model.step_seconds(chosen)
    return OffloadPlan(chosen, model.fetch_bytes_per_s, model.tokens_per_s(chosen), fetch / max(compute, fetch))


def plan_offload(model: MoEModel, store: StreamedStore, max_seqs: int) -> OffloadPlan:
    """Measure the fetch rate (filling the pool) and the expert GEMM rates, and plan the running
    set for ``model`` with its streamed ``store`` (at most ``max_seqs`` sequences)."""
    config = model.config
    fetch_rate = store.warm()
    hidden, ffn = store.pool.w_down.shape[1], store.pool.w_down.shape[2]
    num_sparse = len(store.layer_ids())
    routed_active = num_sparse * config.num_experts_per_tok * 3 * hidden * ffn
    cost = StepCostModel(
        num_experts=store.num_experts, top_k=config.num_experts_per_tok, num_sparse_layers=num_sparse,
        num_slots=store.capacity, bytes_per_expert=store.bytes_per_expert, expert_flops_per_row=6.0 * hidden * ffn,
        dense_flops_per_token=2.0 * (config.active_params_per_token - routed_active),
        fetch_bytes_per_s=fetch_rate, gemm_flops_per_s=measure_expert_gemm_rates(store, max_seqs),
    )
    return plan_running_set(cost, max_seqs)


def measure_expert_gemm_rates(store: StreamedStore, max_rows: int) -> dict[int, float]:
    """FLOP/s of one expert (gate/up and down GEMMs through ``linear``) by row count, cycling
    over the pool's slots so the weights come from memory as in a step, not from a warm cache."""
    pool = store.pool
    hidden, ffn = pool.w_down.shape[1], pool.w_down.shape[2]
    rates = {}
    for rows in [r for r in _GEMM_ROWS if r <= max(max_rows, 1)]:
        x = torch.randn(rows, hidden, dtype=pool.w_down.dtype, device=pool.w_down.device)
        h = torch.randn(rows, ffn, dtype=pool.w_down.dtype, device=pool.w_down.device)
        best = float("inf")
        for i in range(_GEMM_REPEATS + 1):  # the first call warms the kernel up
            slot = i % store.capacity
            start = time.perf_counter()
            linear(x, pool.w_gate_up[slot]).contiguous()
            linear(h, pool.w_down[slot]).contiguous()
            if pool.w_down.is_cuda:
                torch.cuda.synchronize(pool.w_down.device)
            if i:
                best = min(best, time.perf_counter() - start)
        rates[rows] = 6.0 * hidden * ffn * rows / best
    return rates


@dataclass(slots=True)
class OffloadStats:
    """``EngineStats.offload``: where the weights live and what streaming them cost."""

    resident_dense_bytes: int  # every weight but the routed experts
    pool_bytes: int  # the expert pool (fixed at load)
    pool_slots: int
    model_expert_bytes: int  # all routed experts of the model, in the slower tier
    bytes_fetched: int
    num_hits: int
    num_misses: int
    num_prefetched: int
    hit_rate: float  # requested experts already in the pool or on their way
    fetch_s: float  # seconds the fetch thread copied
    fetch_wait_s: float  # seconds compute waited for a copy
    fetch_bytes_per_s: float  # measured at load
    planned_running_seqs: int
    predicted_fetch_share: float
    read_in_place: bool = False  # decode steps read the experts from the memory-mapped checkpoint (no copies)

    @property
    def fetch_overlap(self) -> float:
        """Share of fetch time hidden behind compute."""
        return max(0.0, 1.0 - self.fetch_wait_s / self.fetch_s) if self.fetch_s else 1.0

    @classmethod
    def of(cls, model: MoEModel, store: StreamedStore, plan: OffloadPlan) -> OffloadStats:
        s = store.stats
        num_experts_total = len(store.layer_ids()) * store.num_experts
        return cls(model.dense_weight_bytes, store.nbytes, store.capacity, num_experts_total * store.bytes_per_expert,
                   s.bytes_fetched, s.num_hits, s.num_misses, s.num_prefetched, s.hit_rate, s.fetch_s, s.wait_s,
                   plan.fetch_bytes_per_s, plan.running_seqs, plan.predicted_fetch_share,
                   store.in_place_table(store.layer_ids()[0]) is not None)


def step_fetch_fields(before: StreamStats, after: StreamStats) -> dict[str, float]:
    """One step's timeline fields: what it fetched and how long compute waited."""
    return {
        "fetched_bytes": after.bytes_fetched - before.bytes_fetched,
        "fetch_s": after.fetch_s - before.fetch_s,
        "fetch_wait_s": after.wait_s - before.wait_s,
        "expert_hits": after.num_hits - before.num_hits,
        "expert_misses": after.num_misses - before.num_misses,
    }
