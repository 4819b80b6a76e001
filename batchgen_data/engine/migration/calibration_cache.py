"""A calibrated step model kept on disk, per machine, model and engine settings
(``load_or_calibrate``), as the GEMM plan is (``model/gemm_tuning.py``).

Why: calibrating takes ~0.2 s of decode steps on the demo model, before an actor's first real
step, in every actor of every job; on a job of a few seconds that is as large as what
rebalancing gains (issue #33). The line it measures belongs to the machine, the checkpoint and
the engine's settings, not to the job, and the engine scales it to the level its own steps show
during the job (``step_model.StepSums.fit``): a cached line loses nothing a fresh one had. So the
first engine to calibrate on a machine writes it, and later engines with the same key read it.

The key: the CPU, torch and its thread count, the checkpoint (its folder and ``config.json``
bytes), the engine's settings except the ones that do not change a step (seed, timeline, the
scheduler's), and the sizes timed. A file that cannot be read is ignored and written again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from batchgen_data.engine.migration.calibration import Calibration, calibrate_engine
from batchgen_data.paths import write_cache_file
from batchgen_data.rebalance.core.step_model import StepModel, calibration_sizes

if TYPE_CHECKING:
    from batchgen_data.engine.engine import Engine

logger = logging.getLogger(__name__)

# EngineConfig fields that do not change what a decode step at a given running-set size costs
# (the running-set cap enters the key through the sizes timed).
_NOT_IN_KEY = ("seed", "collect_timeline", "rank_timeout_s", "max_num_seqs", "suspend_policy",
               "refill_threshold", "swap_space_bytes")


def calibration_key(engine: Engine) -> str:
    """What a cached calibration of ``engine`` must match, as 16 hex digits."""
    import torch

    from batchgen_data.hardware import cpu_model

    settings = {k: v for k, v in asdict(engine.config).items() if k not in _NOT_IN_KEY}
    config_json = Path(engine.model_path, "config.json")
    config_bytes = config_json.read_bytes() if config_json.is_file() else b""
    parts = [platform.machine(), cpu_model(), torch.__version__, torch.get_num_threads(),
             str(Path(engine.model_path).resolve()), hashlib.sha1(config_bytes).hexdigest(),
             sorted(settings.items()), calibration_sizes(engine.max_running_seqs)]
    return hashlib.sha1(repr(parts).encode()).hexdigest()[:16]


def load_or_calibrate(engine: Engine, folder: Path | None) -> Calibration:
    """The cached calibration for ``engine`` under ``folder``, else a fresh one
    (``calibration.calibrate_engine``), then cached there. ``folder`` None: no cache.

    Args:
        engine (Engine): an idle engine nothing else drives yet (a fresh calibration steps it).
        folder (Path | None): where calibrations are kept (``paths.cache_dir() / "step-models"``).
    """
    path = None if folder is None else folder / f"{calibration_key(engine)}.json"
    if path is not None and path.is_file():
        started = time.perf_counter()
        try:
            data = json.loads(path.read_text())
            model = StepModel(float(data["base_s"]), float(data["per_seq_s"]))
            return Calibration(model, time.perf_counter() - started, tuple(data["sizes"]), cached=True)
        except (ValueError, KeyError, TypeError, OSError) as err:
            logger.warning("ignoring unreadable step-model calibration %s: %s", path, err)
    calibration = calibrate_engine(engine)
    if path is not None and calibration.model is not None:
        data = {"base_s": calibration.model.base_s, "per_seq_s": calibration.model.per_seq_s,
                "sizes": list(calibration.sizes), "seconds": calibration.seconds}
        try:
            write_cache_file(path, json.dumps(data))  # actors calibrating at once do not corrupt it
        except OSError as err:
            logger.warning("could not cache the step-model calibration at %s: %s", path, err)
    return calibration
