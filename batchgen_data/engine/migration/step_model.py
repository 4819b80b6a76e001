"""How long an engine step takes with ``n`` sequences running: a measured linear model.

``step_s(n) = base_s + per_seq_s * n`` is fitted by least squares over the engine's recent
decode steps (exponentially decayed, so it follows the machine's current load). The sums are
plain numbers, so the actors of one stage (same model, same engine config) can pool theirs: an
actor that has only ever run full steps still gets a slope from its peers.

What it is for: whether splitting a running set across two engines pays. On a CPU each sequence
adds its own lm_head and attention work to a step (``per_seq_s`` large); on an accelerator a
decode step is bound by reading the weights and barely grows with ``n`` (``per_seq_s`` near 0),
so moving running sequences away from a busy engine gains nothing there.
"""

from __future__ import annotations

from dataclasses import dataclass

# Weight of a step observed k steps ago: DECAY**k (about the last 200 steps count).
DECAY = 0.995
# Below this spread of running counts (variance, in sequences squared) the slope is unknown and
# taken as 0: a flat model, under which splitting a running set never looks like a gain.
_MIN_N_VARIANCE = 0.25
# A step counts as decode-bound when it forwards at most this many tokens per running sequence
# (prefill-heavy steps cost more per sequence than the model describes).
_DECODE_TOKENS_PER_SEQ = 2
# An engine's first decode steps run cold (caches, allocator, first shapes): not observed.
_WARM_UP_STEPS = 8


@dataclass(frozen=True, slots=True)
class StepModel:
    """Seconds per step with ``n`` running sequences: ``base_s + per_seq_s * n``."""

    base_s: float
    per_seq_s: float

    def step_s(self, n: int) -> float:
        return self.base_s + self.per_seq_s * n if n > 0 else 0.0


@dataclass(slots=True)
class StepSums:
    """Decayed least-squares sums over (running sequences, step seconds) observations."""

    w: float = 0.0
    n: float = 0.0
    nn: float = 0.0
    t: float = 0.0
    nt: float = 0.0
    num_skipped: int = 0  # warm-up steps passed over so far

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

    def merged(self, other: StepSums) -> StepSums:
        return StepSums(self.w + other.w, self.n + other.n, self.nn + other.nn, self.t + other.t,
                        self.nt + other.nt, max(self.num_skipped, other.num_skipped))

    def fit(self) -> StepModel | None:
        """The least-squares line; None before any decode step. A slope that the observations
        cannot pin down (they all ran the same number of sequences) is 0."""
        if self.w < 1.0:
            return None
        mean_n, mean_t = self.n / self.w, self.t / self.w
        var_n = self.nn / self.w - mean_n ** 2
        if var_n < _MIN_N_VARIANCE:
            return StepModel(mean_t, 0.0)
        slope = max(0.0, (self.nt / self.w - mean_n * mean_t) / var_n)
        base = mean_t - slope * mean_n
        if base < 0.0:  # the line crosses zero: proportional through the mean instead
            return StepModel(0.0, mean_t / mean_n)
        return StepModel(base, slope)
