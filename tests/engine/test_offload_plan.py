"""The running-set plan for streamed experts: more sequences in flight when fetching costs more."""

from __future__ import annotations

from dataclasses import replace

from batchgen_data.engine.worker.offload import StepCostModel, plan_running_set

# Shapes of the offload benchmark's model (hidden 768, FFN 2048, 16 experts, top-2, 4 layers),
# GEMM rates memory-bound with few rows and flat from 64 rows on (~150 GFLOP/s).
COST = StepCostModel(
    num_experts=16, top_k=2, num_sparse_layers=4, num_slots=17, bytes_per_expert=18_874_368,
    expert_flops_per_row=6.0 * 768 * 2048, dense_flops_per_token=2.0 * 13e6, fetch_bytes_per_s=10e9,
    gemm_flops_per_s={1: 2e9, 4: 8e9, 16: 30e9, 64: 150e9, 1024: 150e9},
)


def test_slower_fetches_plan_a_larger_running_set():
    # Once every GEMM runs at its peak rate, more sequences only amortise fetches.
    fast = plan_running_set(replace(COST, fetch_bytes_per_s=1e12), 1024)
    slow = plan_running_set(replace(COST, fetch_bytes_per_s=1e9), 1024)
    assert fast.running_seqs < 1024 and slow.running_seqs == 1024
    assert slow.predicted_fetch_share > fast.predicted_fetch_share


def test_the_plan_stays_within_max_num_seqs_and_near_the_best_throughput():
    for max_seqs in (1, 7, 64, 300):
        plan = plan_running_set(COST, max_seqs)
        assert 1 <= plan.running_seqs <= max_seqs
        best = max(COST.tokens_per_s(n) for n in range(1, max_seqs + 1))
        assert plan.predicted_tokens_per_s >= 0.95 * best


def test_a_pool_holding_every_touched_expert_fetches_nothing():
    roomy = replace(COST, num_slots=64)
    assert roomy.step_seconds(256)[1] == 0.0 and COST.step_seconds(256)[1] > 0.0
