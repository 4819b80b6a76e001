"""The step model (``engine/migration/step_model.py``) with scripted step times and no model: the
calibration sees the slope, the job's own steps set the level, and a slope is never read as 0
from steps that all ran one size."""

from __future__ import annotations

import pytest

from batchgen_data.rebalance.core.step_model import (
    StepModel,
    StepSums,
    calibrate,
    calibration_sizes,
    fit_line,
)


class _ScriptedSteps:
    """A ``time_step`` callable: ``base + slope * n``, slowed by a load that drifts linearly with
    every step timed, with the first step at each new size running cold (+50%)."""

    def __init__(self, base_s=0.012, slope_s=0.0015, drift_per_step=0.0, cold=0.5):
        self.base_s, self.slope_s, self.drift, self.cold = base_s, slope_s, drift_per_step, cold
        self.calls: list[int] = []

    def __call__(self, n: int) -> float:
        is_new_size = not self.calls or self.calls[-1] != n
        self.calls.append(n)
        seconds = (self.base_s + self.slope_s * n) * (1 + self.drift * len(self.calls))
        return seconds * (1 + self.cold) if is_new_size else seconds


def _clock(step_s: float = 0.01):
    now = [0.0]

    def clock() -> float:
        now[0] += step_s
        return now[0]

    return clock


def test_calibration_recovers_the_line_through_cold_steps_and_a_drifting_load():
    steps = _ScriptedSteps(drift_per_step=0.02)  # every step 2% slower than the one before
    model = calibrate(steps, calibration_sizes(256))
    assert steps.calls == [2, 2, 2, 16, 16, 16, 2, 2, 2]  # up, then down: the drift cancels
    # The line's shape (slope against base) is the engine's: the drift only moves its level,
    # which the job's own steps set anyway (``StepSums.fit``).
    assert model.is_slope_known and model.per_seq_s / model.base_s == pytest.approx(0.0015 / 0.012)
    # Without the return visit, the same drift tilts the line.
    tilted = calibrate(_ScriptedSteps(drift_per_step=0.02), [1, 16], max_s=0.065, clock=_clock())  # 6 steps
    assert tilted.per_seq_s / tilted.base_s > 1.05 * 0.0015 / 0.012


def test_calibration_stops_at_its_budget_and_needs_two_sizes():
    assert calibrate(_ScriptedSteps(), [1, 16], max_s=0.0, clock=_clock()) is None  # nothing timed
    assert calibrate(_ScriptedSteps(), [1, 16], max_s=0.035, clock=_clock()) is None  # one size: no slope
    assert calibrate(lambda n: None, [1, 16]) is None  # no step could be timed
    assert calibrate(lambda n: 0.02, [1, 8]) == StepModel(pytest.approx(0.02), 0.0)  # measured flat: an accelerator
    assert calibration_sizes(8) == [2, 8] and calibration_sizes(3) == [1, 3] and calibration_sizes(1) == [1]
    assert fit_line({4: 0.01}) is None


def _observed(n: int, step_s: float, count: int = 40) -> StepSums:
    sums = StepSums(num_skipped=8)  # warmed up
    for _ in range(count):
        sums.observe(n, n, step_s)
    return sums


def test_steps_at_one_size_never_make_a_zero_slope():
    # The engine: every step of the job ran 8 sequences at 36 ms.
    one_size = _observed(8, 0.036)
    assert one_size.fit().is_slope_known is False  # the level is known, the slope is not
    assert one_size.fit().step_s(8) == pytest.approx(0.036)
    # With the engine's calibrated line (24 ms at 3, 28 at 5, 36 at 8, as the issue measured),
    # the slope is the calibration's and the level the job's.
    one_size.calibrate(fit_line({3: 0.024, 5: 0.028, 8: 0.036}))
    model = one_size.fit()
    assert model.is_slope_known and model.step_s(8) == pytest.approx(0.036)
    assert model.step_s(4) == pytest.approx(0.026, rel=0.05) and model.per_seq_s > 0.002


def test_the_calibrated_line_scales_to_the_measured_level_and_pools_across_engines():
    calibrated = StepModel(0.010, 0.002)
    busy = _observed(4, 2 * calibrated.step_s(4))  # another engine shares the cores: every step twice as slow
    busy.calibrate(calibrated)
    assert busy.fit().base_s == pytest.approx(0.020) and busy.fit().per_seq_s == pytest.approx(0.004)
    fresh = StepSums()
    fresh.calibrate(StepModel(0.014, 0.002))
    assert fresh.fit() == StepModel(pytest.approx(0.014), pytest.approx(0.002))  # no steps yet: the line
    pooled = fresh.merged(StepSums()).merged(busy)  # two calibrated engines and one without
    assert pooled.calibrated == StepModel(pytest.approx(0.012), pytest.approx(0.002))
    assert StepSums().fit() is None
    # Observations that span several sizes still give a line without a calibration.
    spread = StepSums(num_skipped=8)
    for n in [1, 2, 4, 8] * 10:
        spread.observe(n, n, 0.008 + 0.003 * n)
    assert spread.fit() == StepModel(pytest.approx(0.008), pytest.approx(0.003))
