"""Params are checked once: a ``SamplingParams`` / ``PoolingParams`` checks its fields when built
and whenever one is set (``validated.py``), and the engine's input processor does not check them
again. Counted here through the row layer and the engine, for pooled and generated rows."""

from __future__ import annotations

import copy
import pickle

import pyarrow as pa
import pytest
from stage_rows import ENGINE_CONFIG

from batchgen_data import BatchGenMap, ConfigError, Engine, EngineConfig, SamplingParams
from batchgen_data.engine.pooling_params import PoolingParams


def _count_verify(monkeypatch, cls) -> list[int]:
    calls = [0]
    verify = cls.verify

    def counted(self):
        calls[0] += 1
        return verify(self)

    monkeypatch.setattr(cls, "verify", counted)
    return calls


def test_a_field_set_after_construction_is_checked_as_it_is_set():
    params = SamplingParams(max_tokens=4, stop="END")
    params.temperature = 1e-7  # valid, and normalized as construction normalizes it
    assert params.temperature == 0.0
    params.stop = ["A", "B"]
    assert params.stop_strings == ("A", "B")
    with pytest.raises(ConfigError, match="top_p"):
        params.top_p = 1.5
    with pytest.raises(ConfigError, match="stop"):
        params.stop = [3]
    assert params.top_p == 1.0 and params.stop == ["A", "B"] and params.stop_strings == ("A", "B")
    with pytest.raises(AttributeError):
        params.max_token = 5  # a misspelt field is not a silent new attribute
    pooling = PoolingParams(task="embed")
    with pytest.raises(ConfigError, match="dimensions"):
        pooling.dimensions = 0
    assert pooling.dimensions is None and pooling.normalize is True


def test_copies_and_pickles_are_not_checked_again_and_stay_checked(monkeypatch):
    params = SamplingParams(max_tokens=4, stop=["x"], logit_bias={"3": 1.0})
    pooling = PoolingParams(task="classify")
    calls = _count_verify(monkeypatch, SamplingParams)
    for clone in (copy.copy(params), copy.deepcopy(params), pickle.loads(pickle.dumps(params))):
        assert clone == params and clone.stop_strings == ("x",) and clone.logit_bias == {3: 1.0}
    assert calls == [0]
    clone = pickle.loads(pickle.dumps(pooling))
    assert clone == pooling
    with pytest.raises(ConfigError):
        clone.use_activation = "yes"  # a restored copy still checks what is set on it


def test_a_pooled_row_is_checked_once(monkeypatch):
    stage = BatchGenMap(model="demo", engine_config=ENGINE_CONFIG, task_type="embed")
    rows = [{"prompt": f"Embed row {i}", "pooling_params": None if i % 2 else {"normalize": False}}
            for i in range(6)]
    pooling_calls = _count_verify(monkeypatch, PoolingParams)
    sampling_calls = _count_verify(monkeypatch, SamplingParams)
    out = stage(pa.Table.from_pylist(rows)).to_pydict()
    assert all(e is None for e in out["__inference_error__"])
    assert all(len(v) > 0 for v in out["embeddings"])
    assert pooling_calls == [len(rows)]  # built (and checked) by the row layer; the engine trusts it
    assert sampling_calls == [0]  # the stage's default sampling params were built with the config


def test_generated_rows_are_checked_once_each_and_stage_defaults_never(monkeypatch):
    stage = BatchGenMap(model="demo", engine_config=ENGINE_CONFIG, max_tokens=2)
    rows = [{"prompt": f"Row {i}", "sampling_params": {"max_tokens": 3} if i < 2 else None} for i in range(5)]
    calls = _count_verify(monkeypatch, SamplingParams)
    out = stage(pa.Table.from_pylist(rows)).to_pydict()
    assert all(e is None for e in out["__inference_error__"])
    assert calls == [2]  # the two rows with their own params; the others share the stage's


def test_the_engine_does_not_check_params_again(monkeypatch):
    engine = Engine("demo", EngineConfig(**ENGINE_CONFIG))
    params = SamplingParams(max_tokens=2, bad_words=["the"], min_tokens=1)
    pooling = PoolingParams(task="embed")
    calls = _count_verify(monkeypatch, SamplingParams)
    pooled = _count_verify(monkeypatch, PoolingParams)
    outs = engine.generate(["Hello", "World"], params)
    assert [o.finish_reason for o in outs] != ["error", "error"]
    assert engine.embed(["Hello"], pooling)[0].embeddings is not None
    assert calls == [0] and pooled == [0]
