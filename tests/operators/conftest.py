"""Fixtures for the pipeline-stage tests: the reference outputs of the mixed rows."""

from __future__ import annotations

import pytest
from stage_rows import ENGINE_CONFIG, GOOD_ROWS, MAX_TOKENS

from batchgen_data import Engine, EngineConfig, SamplingParams


@pytest.fixture(scope="session")
def reference_outputs(demo_path):
    """What ``Engine.generate`` gives for the good rows, keyed by id."""
    engine = Engine(demo_path, EngineConfig(**ENGINE_CONFIG))
    params = [SamplingParams(**{"max_tokens": MAX_TOKENS, "temperature": 0.0, **(r.get("sampling_params") or {})}) for r in GOOD_ROWS]
    outs = engine.generate([r["prompt"] for r in GOOD_ROWS], params)
    return {r["id"]: o for r, o in zip(GOOD_ROWS, outs)}
