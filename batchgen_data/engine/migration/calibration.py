"""Calibrating an engine's step model at start (``calibrate_engine``): decode steps timed at a few
running-set sizes through the ``Engine``'s public API (``DecodeStepTimer``), fitted by
``step_model.calibrate``.

Run it once per engine, before anything else drives the engine (an ``AsyncEngine``'s thread
starts at its first submission): the rebalancing client does, when its actor starts
(``rebalance/client``). Its dummy requests leave nothing behind: they are taken out with
``Engine.export_sequence`` (no KV), their fixed seed leaves the engine's seed stream for real
requests untouched, and the engine's timeline does not record their steps. What stays is what
any run leaves: the engine's counters (forward tokens and kernel seconds, from which
``MigrationCosts`` reads the recompute rate), request ids, and the prefix cache's blocks.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from batchgen_data.engine.sampling_params import SamplingParams
from batchgen_data.rebalance.core.step_model import (
    CALIBRATION_MAX_S,
    StepModel,
    calibrate,
    calibration_sizes,
)

if TYPE_CHECKING:
    from batchgen_data.engine.engine import Engine
    from batchgen_data.engine.request_handle import RequestHandle

logger = logging.getLogger(__name__)

# A dummy request: this many prompt tokens (token ids 1..n: valid in any vocabulary of a checkpoint
# we load), and a budget that outlasts the calibration (~10 steps).
_PROMPT_TOKENS = 8
_MAX_TOKENS = 64
# Steps a resize may take to get every dummy running (one, unless KV memory or the token budget
# makes the scheduler admit them over several).
_MAX_RESIZE_STEPS = 4


class DecodeStepTimer:
    """``timer(n)``: the seconds of one decode step of ``engine`` with ``n`` dummy sequences running
    (``Engine.last_report.step_s``); None if the step was not that (some are suspended for KV
    memory, or one finished). Uses only ``add_request``, ``step``, ``last_report`` and
    ``export_sequence``; ``close()`` (or ``with``) takes every dummy out again.

    Example:
        >>> from batchgen_data import Engine
        >>> with DecodeStepTimer(Engine("demo")) as timer:
        ...     seconds = timer(4)
        >>> seconds > 0
        True
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self._dummies: list[RequestHandle] = []
        max_tokens = max(1, min(_MAX_TOKENS, engine.max_model_len - _PROMPT_TOKENS - 1))  # a short context
        self._params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, seed=0)
        self._collect_timeline = engine.config.collect_timeline
        engine.config.collect_timeline = False  # a job's timeline starts with its own first step

    def __call__(self, n: int) -> float | None:
        if not self._resize(n):
            return None
        self.engine.step()
        report = self.engine.last_report
        if report is None or report.num_running != n or report.num_tokens != n:  # not a decode step at n
            return None
        return report.step_s

    def _resize(self, n: int) -> bool:
        """``n`` dummies running: the newest ones taken out (nothing to run), or new ones added and
        stepped in (their prefill steps are not timed). False if they do not all get to run."""
        self._dummies = [h for h in self._dummies if not h.is_finished]
        while len(self._dummies) > n:
            self.engine.export_sequence(self._dummies.pop())
        if len(self._dummies) == n:
            return True
        prompt = list(range(1, _PROMPT_TOKENS + 1))
        self._dummies += [self.engine.add_request(prompt, self._params) for _ in range(n - len(self._dummies))]
        for _ in range(_MAX_RESIZE_STEPS):
            self.engine.step()
            report = self.engine.last_report
            if report is not None and report.num_running == n and report.num_queued == 0:
                return True
        return False

    def close(self) -> None:
        for handle in self._dummies:
            if not handle.is_finished:
                self.engine.export_sequence(handle)
        self._dummies = []
        self.engine.config.collect_timeline = self._collect_timeline

    def __enter__(self) -> DecodeStepTimer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(frozen=True, slots=True)
class Calibration:
    model: StepModel | None  # None: fewer than two sizes could be timed
    seconds: float  # what calibrating took (reading it, when cached), wall time
    sizes: tuple[int, ...]
    cached: bool = False  # read from disk (``calibration_cache.py``), not timed now


def calibrate_engine(engine: Engine, max_s: float = CALIBRATION_MAX_S) -> Calibration:
    """Calibrate ``engine``'s step model (``step_model.calibrate`` over ``calibration_sizes`` of
    its running set, within ``max_s`` seconds); the engine must have no requests yet.

    Args:
        engine (Engine): an idle engine nothing else drives yet.
        max_s (float, default 1.0): time budget (no timed step starts past it).

    Example:
        >>> from batchgen_data import Engine
        >>> calibration = calibrate_engine(Engine("demo"))
        >>> calibration.sizes  # timed at 2 sequences and at 16, the line through them in .model
        (2, 16)
    """
    started = time.perf_counter()
    sizes = tuple(calibration_sizes(engine.max_running_seqs))
    model = None
    try:
        with DecodeStepTimer(engine) as timer:
            model = calibrate(timer, sizes, max_s=max_s)
            if model is not None and model.per_seq_s == 0.0 and engine.config.resolve_device().type == "cpu":
                # On a CPU each sequence adds matmul rows: a flat line means other work (actors
                # calibrating side by side on few cores) outweighed the sizes. Measure once more.
                model = calibrate(timer, sizes, max_s=max_s)
    except Exception as err:  # a calibration is an estimate: the job runs without one
        logger.warning("could not calibrate the engine's step model: %s", err)
    return Calibration(model, time.perf_counter() - started, sizes)
