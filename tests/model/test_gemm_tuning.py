"""CPU GEMM tuning: every kernel computes x @ w.T, the plan picks what the timer measured fastest,
and a cached plan is reused without measuring again."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchgen_data.model import gemm_tuning, layers
from batchgen_data.model.gemm_tuning import (
    GemmPlan,
    available_kernels,
    bucket_of,
    load_or_tune,
    tune,
)
from batchgen_data.model.layers import _PLAN, linear, use_gemm_plan


@pytest.mark.parametrize("rows", [1, 2, 5, 33, 300])
@pytest.mark.parametrize("shape", [(96, 32), (32, 80)])
def test_every_kernel_computes_x_times_w_transposed(rows, shape):
    torch.manual_seed(0)
    x, w = torch.randn(rows, shape[1]), torch.randn(*shape)
    for name, kernel in available_kernels().items():
        torch.testing.assert_close(kernel(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5, msg=name)


def test_buckets_are_powers_of_two():
    assert [bucket_of(r) for r in (1, 2, 3, 4, 7, 8, 1023, 1024, 10**6)] == [0, 1, 1, 2, 2, 3, 9, 10, 10]


def test_plan_picks_the_fastest_measured_kernel_per_shape_and_bucket():
    weights = {(64, 16): [torch.randn(64, 16)] * 3, (16, 64): [torch.randn(16, 64)]}
    max_rows = {(64, 16): 5, (16, 64): 40}
    # A fake clock: "linear" wins for the wide shape below 4 rows, "weight_left" everywhere else.
    def timer(kernel, x, ws):
        wide_and_few = ws[0].shape == (64, 16) and x.shape[0] < 4
        fast = F.linear if wide_and_few else gemm_tuning._weight_left
        return 1.0 if kernel is fast else 2.0

    plan = tune(weights, max_rows, timer=timer)
    assert plan.choices[(64, 16)] == ["linear", "linear", "weight_left"]  # buckets up to 5 rows
    assert plan.choices[(16, 64)] == ["weight_left"] * 6  # buckets up to 40 rows
    assert plan.kernel_for(2, 64, 16) == "linear" and plan.kernel_for(500, 64, 16) == "weight_left"
    assert plan.kernel_for(2, 8, 8) is None  # not tuned: the static rule applies
    assert GemmPlan.from_json(plan.to_json()) == plan


def test_a_cached_plan_is_loaded_without_measuring(tmp_path, monkeypatch):
    monkeypatch.setattr(gemm_tuning, "load_per_cpu", lambda: 0.1)  # a quiet machine
    weights, max_rows = {(24, 8): [torch.randn(24, 8)]}, {(24, 8): 3}
    first = load_or_tune(weights, max_rows, tmp_path)
    assert len(list(tmp_path.glob("*.json"))) == 1

    def no_tuning(*args, **kwargs):
        raise AssertionError("tuned again although a plan was cached")

    monkeypatch.setattr(gemm_tuning, "tune", no_tuning)
    assert load_or_tune(weights, max_rows, tmp_path) == first


def test_linear_follows_the_plan_and_matches_f_linear(monkeypatch):
    monkeypatch.setattr(_PLAN, "choices", dict(_PLAN.choices))  # leave the process table as found
    x, w, b = torch.randn(3, 16), torch.randn(40, 16), torch.randn(40)
    calls = []

    def spy(x_, w_):
        calls.append(x_.shape[0])
        return gemm_tuning._weight_left(x_, w_)

    monkeypatch.setitem(layers._KERNELS, "weight_left", spy)
    use_gemm_plan(GemmPlan({(40, 16): ["linear", "weight_left"]}))
    torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert calls == [3]  # 3 rows: bucket 1, measured fastest with weight_left
    torch.testing.assert_close(linear(x[:1], w), F.linear(x[:1], w), rtol=1e-5, atol=1e-5)
    assert calls == [3]  # 1 row: bucket 0, F.linear


def test_a_plan_tuned_under_load_is_tuned_again_once_the_machine_is_quiet(tmp_path, monkeypatch):
    weights, max_rows = {(24, 8): [torch.randn(24, 8)]}, {(24, 8): 3}
    load = {"now": 2.0}  # per CPU: a test run holds every core
    monkeypatch.setattr(gemm_tuning, "load_per_cpu", lambda: load["now"])
    tunings = []
    real_tune = gemm_tuning.tune
    monkeypatch.setattr(gemm_tuning, "tune", lambda *a, **k: tunings.append(1) or real_tune(*a, **k))
    first = load_or_tune(weights, max_rows, tmp_path)
    assert first.tuned_under_load() and len(tunings) == 1
    load["now"] = 1.5  # still loaded: the cached plan stands
    assert load_or_tune(weights, max_rows, tmp_path).load_per_cpu == 2.0 and len(tunings) == 1
    load["now"] = 0.2  # quiet: measured again, and the new plan replaces it
    assert load_or_tune(weights, max_rows, tmp_path).load_per_cpu == 0.2 and len(tunings) == 2
    assert not load_or_tune(weights, max_rows, tmp_path).tuned_under_load() and len(tunings) == 2
    # A plan cached before the load was recorded (a bare shape map) counts as tuned under load.
    [path] = tmp_path.glob("*.json")
    path.write_text('{"24x8": ["linear", "linear"]}')
    old = GemmPlan.from_json(path.read_text())
    assert old.choices == {(24, 8): ["linear", "linear"]} and old.tuned_under_load()
