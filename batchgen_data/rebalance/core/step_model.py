"""How long an engine step takes with ``n`` sequences running: a calibrated, measured linear model.

``step_s(n) = base_s + per_seq_s * n``, from two sources:

* **Calibration** (``calibrate``): at engine start, a few decode steps at two sequences and at a
  full running set (up to ``CALIBRATION_MAX_SEQS``), timed back to back, in the order 2, full, 2
  so that a load that drifts during the calibration cancels out of the slope; the line through
  them. This is what shows the slope: a job's own steps run the sizes it happens to run, at
  different moments, under different loads (another engine on the same cores starting or
  stopping), and a line fitted through them has come out flat where the steps were not (issue
  #33: a fitted 0-1.7 ms per sequence where steps took 24 ms at 3 sequences and 36 ms at 8).
* **Observation** (``StepSums``): decayed sums over the engine's decode steps during the job. They
  give the current level: other engines on the same cores make every step slower by about the
  same factor, whatever its size.

``StepSums.fit`` combines them: the calibrated line, scaled to the observed level (the mean
observed step over the calibrated step at the mean observed size). Without a calibration it is
the least-squares line of the observations where they span several sizes; where they all ran
one size, the slope is unknown, never taken as 0: the model says so (``is_slope_known``) and the
move rule then splits no running set on its word (``move_rule.py``).

What it is for: whether splitting a running set across two engines pays. On a CPU each sequence
adds its own lm_head and attention work to a step (``per_seq_s`` large); on an accelerator a
decode step is bound by reading the weights and barely grows with ``n`` (``per_seq_s`` near 0,
measured so at several sizes), so moving running sequences away from a busy engine gains nothing
there. Pure Python: the coordinator's process imports it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

# Weight of a step observed k steps ago: DECAY**k (about the last 200 steps count).
DECAY = 0.995
# Below this spread of running counts (variance, in sequences squared) observations alone cannot
# give a slope.
_MIN_N_VARIANCE = 0.25
# A step counts as decode-bound when it forwards at most this many tokens per running sequence
# (prefill-heavy steps cost more per sequence than the model describes).
_DECODE_TOKENS_PER_SEQ = 2
# An engine's first decode steps run cold (caches, allocator, first shapes): not observed.
_WARM_UP_STEPS = 8
# Calibration: the largest running set timed (larger ones are extrapolated along the line; on the
# demo model a step at 16 sequences takes ~19 ms on one AMD EPYC core, at 2 ~9 ms), the steps timed
# per visit of a size (the fastest counts: a size's first step runs cold, and contention only
# ever slows a step), and the default time budget (no step starts past it).
CALIBRATION_MAX_SEQS = 16
CALIBRATION_STEPS_PER_VISIT = 3
CALIBRATION_MAX_S = 1.0


@dataclass(frozen=True, slots=True)
class StepModel:
    """Seconds per step with ``n`` running sequences: ``base_s + per_seq_s * n``.

    ``is_slope_known`` is False for a flat stand-in fitted from steps that all ran one size: the
    level is measured, the slope is not.
    """

    base_s: float
    per_seq_s: float
    is_slope_known: bool = True

    def step_s(self, n: int) -> float:
        return self.base_s + self.per_seq_s * n if n > 0 else 0.0

    def scaled(self, factor: float) -> StepModel:
        return StepModel(self.base_s * factor, self.per_seq_s * factor, self.is_slope_known)


@dataclass(slots=True)
class StepSums:
    """Decayed least-squares sums over (running sequences, step seconds) observations, and the
    sums of the calibrated lines of the engines merged into it (``calibrated``)."""

    w: float = 0.0
    n: float = 0.0
    nn: float = 0.0
    t: float = 0.0
    nt: float = 0.0
    num_skipped: int = 0  # warm-up steps passed over so far
    cal_w: float = 0.0  # calibrated engines merged in
    cal_base_s: float = 0.0  # sum of their ``base_s``
    cal_per_seq_s: float = 0.0  # sum of their ``per_seq_s``

    def observe(self, num_running: int, num_tokens: int, step_s: float) -> None:
        """Add one step (ignored unless decode-bound, i.e. not a prefill-heavy step, and past
        the engine's first few)."""
        if num_running <= 0 or num_tokens > _DECODE_TOKENS_PER_SEQ * num_running:
            return
        if self.num_skipped < _WARM_UP_STEPS:
            self.num_skipped += 1
            return
        self.w, self.n, self.nn = DECAY * self.w + 1.0, DECAY * self.n + num_running, DECAY * self.nn + num_running ** 2
        self.t, self.nt = DECAY * self.t + step_s, DECAY * self.nt + num_running * step_s

    def calibrate(self, model: StepModel) -> None:
        """Set this engine's calibrated line (``calibrate``); it replaces an earlier one."""
        self.cal_w, self.cal_base_s, self.cal_per_seq_s = 1.0, model.base_s, model.per_seq_s

    def merged(self, other: StepSums) -> StepSums:
        return StepSums(self.w + other.w, self.n + other.n, self.nn + other.nn, self.t + other.t,
                        self.nt + other.nt, max(self.num_skipped, other.num_skipped), self.cal_w + other.cal_w,
                        self.cal_base_s + other.cal_base_s, self.cal_per_seq_s + other.cal_per_seq_s)

    def minus(self, other: StepSums) -> StepSums:
        """These sums without ``other``'s (one merged in earlier): ``merged``'s inverse, so a
        running total over many workers replaces one worker's sums in O(1)."""
        return StepSums(self.w - other.w, self.n - other.n, self.nn - other.nn, self.t - other.t,
                        self.nt - other.nt, self.num_skipped, self.cal_w - other.cal_w,
                        self.cal_base_s - other.cal_base_s, self.cal_per_seq_s - other.cal_per_seq_s)

    @property
    def calibrated(self) -> StepModel | None:
        """The mean calibrated line of the engines merged in; None if none was calibrated."""
        if self.cal_w <= 0.0:
            return None
        return StepModel(self.cal_base_s / self.cal_w, self.cal_per_seq_s / self.cal_w)

    def fit(self) -> StepModel | None:
        """The model (module docstring): the calibrated line at the observed level; else the
        observations' least-squares line; None before a calibration or any decode step."""
        calibrated = self.calibrated
        if self.w < 1.0:
            return calibrated
        mean_n, mean_t = self.n / self.w, self.t / self.w
        if calibrated is not None:
            expected = calibrated.base_s + calibrated.per_seq_s * mean_n  # at the observed mean size
            return calibrated.scaled(mean_t / expected) if expected > 0 else calibrated
        var_n = self.nn / self.w - mean_n ** 2
        if var_n < _MIN_N_VARIANCE:
            return StepModel(mean_t, 0.0, is_slope_known=False)
        slope = max(0.0, (self.nt / self.w - mean_n * mean_t) / var_n)
        base = mean_t - slope * mean_n
        if base < 0.0:  # the line crosses zero: proportional through the mean instead
            return StepModel(0.0, mean_t / mean_n)
        return StepModel(base, slope)


def calibration_sizes(max_running_seqs: int, max_seqs: int = CALIBRATION_MAX_SEQS) -> list[int]:
    """The running-set sizes ``calibrate`` times: 2 and ``min(max_running_seqs, max_seqs)`` (1
    and the cap for a cap of 2 or 3; 1 alone for a cap of 1).

    Not 1 where a cap allows more: one sequence makes every matmul a matrix-vector product, which
    runs on its own kernels and does not lie on the line through the larger sizes (on a 2-core
    AMD EPYC with 2 threads, the demo model's step took 13.7 ms at 1 sequence, 7.5 ms at 2 and
    12 ms at 16: a line through 1 and 16 came out flat).

    Example:
        >>> calibration_sizes(256), calibration_sizes(8), calibration_sizes(3), calibration_sizes(1)
        ([2, 16], [2, 8], [1, 3], [1])
    """
    high = max(1, min(max_running_seqs, max_seqs))
    return sorted({2 if high >= 4 else 1, high})


def calibrate(time_step: Callable[[int], float | None], sizes: Sequence[int],
              steps_per_visit: int = CALIBRATION_STEPS_PER_VISIT, max_s: float = CALIBRATION_MAX_S,
              clock: Callable[[], float] = time.perf_counter) -> StepModel | None:
    """The step model of one engine, from decode steps timed at a few running-set sizes.

    The sizes are visited in increasing order and then decreasing again (``[2, 16, 2]``),
    ``steps_per_visit`` steps per visit of which the fastest counts; a size's time is the mean
    over its visits, so a load that drifts during the calibration slows both ends of the line
    alike instead of tilting it. The result is the least-squares line through them
    (``fit_line``).

    Args:
        time_step (Callable[[int], float | None]): runs one decode step with ``n`` sequences
            running and returns its seconds; None when it could not (that sample is skipped).
            ``calibration.DecodeStepTimer`` builds one from an ``Engine``.
        sizes (Sequence[int]): running-set sizes, increasing (``calibration_sizes``).
        steps_per_visit (int, default 3): timed steps per visit of a size.
        max_s (float, default 1.0): time budget; no step starts past it.
        clock (Callable[[], float], default ``time.perf_counter``): for the budget.

    Returns:
        The fitted ``StepModel``; None if fewer than two sizes were timed (no slope).

    Example:
        >>> model = calibrate(lambda n: 0.010 + 0.002 * n, [1, 4, 8])
        >>> round(model.base_s, 6), round(model.per_seq_s, 6)
        (0.01, 0.002)
    """
    order = [*sizes, *reversed(list(sizes)[:-1])]
    visits: dict[int, list[float]] = {}
    start = clock()
    for n in order:
        times = []
        for _ in range(steps_per_visit):
            if clock() - start > max_s:
                break
            seconds = time_step(n)
            if seconds is not None and seconds > 0:
                times.append(seconds)
        if times:
            visits.setdefault(n, []).append(min(times))
    return fit_line({n: statistics.fmean(times) for n, times in visits.items()})


def fit_line(step_s_by_size: Mapping[int, float]) -> StepModel | None:
    """Least-squares line through (size, seconds) points, its slope at least 0 (a measured flat
    step, as on an accelerator, is 0) and its base at least 0; None for fewer than two sizes.

    Example:
        >>> model = fit_line({1: 0.012, 4: 0.018, 8: 0.023, 16: 0.034})
        >>> round(model.base_s * 1000, 1), round(model.per_seq_s * 1000, 2)
        (11.4, 1.43)
    """
    if len(step_s_by_size) < 2:
        return None
    ns, ts = list(step_s_by_size), list(step_s_by_size.values())
    mean_n, mean_t = statistics.fmean(ns), statistics.fmean(ts)
    var_n = statistics.fmean((n - mean_n) ** 2 for n in ns)
    slope = max(0.0, statistics.fmean((n - mean_n) * (t - mean_t) for n, t in zip(ns, ts)) / var_n)
    base = mean_t - slope * mean_n
    if base < 0.0:  # the line crosses zero: proportional through the mean instead
        return StepModel(0.0, mean_t / mean_n)
    return StepModel(base, slope)
