"""Benchmark instrumentation: one actor's engine timeline and counters, as a JSON file.

``BatchGenOperator(stats_dir=...)`` rewrites ``<stats_dir>/actor-<pid>.json`` after every batch;
``benchmarks/skew.py`` reads them back to compare runs with and without rebalancing.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchgen_data.engine.engine import Engine


def write_stats_report(stats_dir: str | Path, engine: Engine, rebalance_stats: dict) -> Path:
    """Write this process's report atomically (a reader never sees half a file) and return its
    path.

    Args:
        stats_dir (str | Path): an existing folder, shared by the stage's actors.
        engine (Engine): the actor's engine, with ``config.collect_timeline`` on.
        rebalance_stats (dict): the actor's rebalancing counters (empty without rebalancing).
    """
    report = {
        "pid": os.getpid(),
        "engine": asdict(engine.stats()),
        "rebalance": rebalance_stats,
        "start_wall": engine.start_wall,
        "timeline": engine.timeline,
    }
    path = Path(stats_dir) / f"actor-{os.getpid()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report))
    os.replace(tmp, path)
    return path
