"""The step model's calibration is kept per machine, model and settings: a later engine reads it
instead of stepping dummies, and anything that changes a step's cost calls for a fresh one."""

import json

import pytest

from batchgen_data import Engine, EngineConfig
from batchgen_data.engine.migration import calibration_cache
from batchgen_data.engine.migration.calibration_cache import calibration_key, load_or_calibrate


@pytest.fixture(scope="module")
def engine():
    return Engine("demo")


def test_a_second_engine_reads_the_first_ones_line(engine, tmp_path):
    first = load_or_calibrate(engine, tmp_path)
    assert not first.cached and first.model is not None and first.model.per_seq_s > 0
    [path] = tmp_path.glob("*.json")
    assert json.loads(path.read_text())["per_seq_s"] == first.model.per_seq_s

    second = load_or_calibrate(engine, tmp_path)
    assert second.cached and second.model == first.model and second.sizes == first.sizes
    assert second.seconds < first.seconds / 5


def test_an_unreadable_file_is_measured_again_and_rewritten(engine, tmp_path):
    path = tmp_path / f"{calibration_key(engine)}.json"
    path.write_text("{not json")
    fresh = load_or_calibrate(engine, tmp_path)
    assert not fresh.cached and fresh.model is not None
    assert json.loads(path.read_text())["base_s"] == fresh.model.base_s


def test_no_folder_means_no_cache(engine, monkeypatch):
    calls = []
    real = calibration_cache.calibrate_engine
    monkeypatch.setattr(calibration_cache, "calibrate_engine", lambda e: calls.append(1) or real(e))
    load_or_calibrate(engine, None)
    load_or_calibrate(engine, None)
    assert len(calls) == 2


def test_the_key_follows_what_changes_a_step_and_ignores_what_does_not(engine):
    key = calibration_key(engine)
    same = engine.config
    try:
        engine.config = EngineConfig(seed=7, collect_timeline=True, suspend_policy="shortest_first")
        assert calibration_key(engine) == key  # the scheduler's and the run's settings
        engine.config = EngineConfig(attention_batch_size=8)
        assert calibration_key(engine) != key  # how a step runs
    finally:
        engine.config = same


def test_a_flat_line_on_a_cpu_is_measured_once_more(engine, monkeypatch):
    """Actors calibrating side by side on 2 cores once timed 16 sequences no slower than 2."""
    from batchgen_data.engine.migration import calibration
    from batchgen_data.rebalance.core.step_model import StepModel

    lines = [StepModel(0.004, 0.0), StepModel(0.004, 0.0004)]
    monkeypatch.setattr(calibration, "calibrate", lambda timer, sizes, max_s: lines.pop(0))
    assert calibration.calibrate_engine(engine).model.per_seq_s == 0.0004 and not lines
