"""Ray Data LLM's processor config through our import, as Ray's ``test_processor_base.py``
(``TestProcessorConfig``) and the 2.60 docstrings check it: the same values coerced, the same
``pydantic.ValidationError`` texts, the same ``model_dump()``."""

from __future__ import annotations

import pydantic
import pytest

from batchgen_data import ProcessorConfig, vLLMEngineProcessorConfig


@pytest.mark.parametrize(("given", "stored"), [
    (1, 1), (2, 2), (10, 10), ("1", 1), (1.0, 1), ("1.0", 1), ((1, 1), (1, 1)), ((1, 2), (1, 2)), ((2, 8), (2, 8)),
    (("1", 2), (1, 2)), ((1, "2"), (1, 2)), ([1, "2"], (1, 2)),
])
def test_concurrency_is_coerced_as_ray_coerces_it(given, stored):
    assert vLLMEngineProcessorConfig(model_source="demo", concurrency=given).concurrency == stored
    assert ProcessorConfig(concurrency=given).concurrency == stored


@pytest.mark.parametrize(("bad", "message"), [
    (0, "positive integer"), (-5, "positive integer"), ((1, 2, 3), "at most 2 items"), ((0, 1), "positive integers"),
    ((1, 0), "positive integers"), ((-1, 2), "positive integers"), ((1, -2), "positive integers"),
    ((1, 2.5), "a number with a fractional part"), (1.1, "a number with a fractional part"),
    ("2.1", "unable to parse string"), ((5, 2), "min > max"),
])
def test_bad_concurrency_is_a_validation_error_with_rays_text(bad, message):
    with pytest.raises(pydantic.ValidationError) as error:
        vLLMEngineProcessorConfig(model_source="demo", concurrency=bad)
    assert message in str(error.value)
    assert isinstance(error.value, ValueError)  # pytest.raises(ValueError) catches it too, as with Ray's


def test_get_concurrency_is_rays():
    config = vLLMEngineProcessorConfig(model_source="demo", concurrency=4)
    assert config.get_concurrency() == {"min_size": 1, "max_size": 4}
    assert config.get_concurrency(autoscaling_enabled=False) == {"size": 4}
    assert vLLMEngineProcessorConfig(model_source="demo", concurrency=(2, 8)).get_concurrency() == {
        "min_size": 2, "max_size": 8}


def test_model_dump_has_rays_fields_in_rays_order_then_ours():
    from ray.data.llm import vLLMEngineProcessorConfig as Rays

    ours = vLLMEngineProcessorConfig(model_source="m").model_dump()
    theirs = Rays(model_source="m").model_dump()
    assert list(ours)[: len(theirs)] == list(theirs) and {k: ours[k] for k in theirs} == theirs
    assert list(ours)[len(theirs):] == ["num_cpus", "rebalance"]
    assert ours["engine_kwargs"] == {"task_type": "generate"}  # Ray copies task_type there


def test_fields_are_validated_on_assignment_and_model_source_is_required():
    config = vLLMEngineProcessorConfig(model_source="demo")
    config.concurrency = "3"
    assert config.concurrency == 3
    with pytest.raises(pydantic.ValidationError):
        config.concurrency = 0
    with pytest.raises(pydantic.ValidationError, match="model_source"):
        vLLMEngineProcessorConfig()
    with pytest.raises(pydantic.ValidationError, match="Invalid task type: foo"):
        vLLMEngineProcessorConfig(model_source="demo", task_type="foo")
    with pytest.raises(pydantic.ValidationError, match="Extra inputs are not permitted"):
        vLLMEngineProcessorConfig(model_source="demo", not_a_field=1)


def test_it_is_a_ray_config():
    import ray.data.llm

    config = vLLMEngineProcessorConfig(model_source="demo")
    assert isinstance(config, ray.data.llm.vLLMEngineProcessorConfig)
    assert isinstance(config, ray.data.llm.ProcessorConfig) and isinstance(config, pydantic.BaseModel)


def test_the_callers_engine_kwargs_are_left_as_given():
    """Ray's validator writes ``task_type`` into the ``engine_kwargs`` dict it is given; ours
    validates a copy, so a dict shared with other code (an ``EngineConfig``'s fields) stays as it was."""
    shared = {"max_num_seqs": 4}
    config = vLLMEngineProcessorConfig(model_source="demo", engine_kwargs=shared)
    assert shared == {"max_num_seqs": 4} and config.engine_kwargs == {"max_num_seqs": 4, "task_type": "generate"}
