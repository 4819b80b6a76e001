"""Rows of a processor run through our import, as Ray's engine-processor and stage tests read
them: ``embeddings`` a float32 ``np.ndarray`` (equal for equal prompts), ``__inference_error__``
``""`` on success in every path and ``TypeName: message`` on an error row, which skips
postprocess."""

from __future__ import annotations

import numpy as np
import pytest
import ray

from batchgen_data import build_processor, vLLMEngineProcessorConfig

pytestmark = pytest.mark.timeout(240)


def test_embeddings_are_float32_arrays_equal_for_equal_prompts(ray_cluster, demo_path):
    config = vLLMEngineProcessorConfig(model_source=str(demo_path), task_type="embed", batch_size=8, concurrency=1,
                                       chat_template_stage=False, detokenize_stage=False)
    seen = {}

    def postprocess(row):
        seen.setdefault("type", type(row["embeddings"]))
        return {"prompt": row["prompt"], "embeddings": row["embeddings"], "shape": list(row["embeddings"].shape)}

    processor = build_processor(config, preprocess=lambda row: {"prompt": row["text"]}, postprocess=postprocess)
    texts = ["Hello world!", "Good morning!", "Hello world!"]
    out = processor(ray.data.from_items([{"text": t} for t in texts])).take_all()
    assert len(out) == 3
    for row in out:
        assert isinstance(row["embeddings"], np.ndarray) and row["embeddings"].dtype == np.float32
        assert row["embeddings"].shape == (row["shape"][0],) and row["shape"][0] > 0
    hello = [row["embeddings"] for row in out if row["prompt"] == "Hello world!"]
    assert (hello[0] == hello[1]).all()  # the second did not take the first's cached prefix


@pytest.mark.parametrize("continue_on_error", [False, True])
def test_success_rows_say_empty_string_in_every_path(ray_cluster, demo_path, continue_on_error):
    config = vLLMEngineProcessorConfig(model_source=str(demo_path), batch_size=4, concurrency=1,
                                       should_continue_on_error=continue_on_error)
    processor = build_processor(config, preprocess=lambda row: {
        "messages": [{"role": "user", "content": row["text"]}], "sampling_params": {"max_tokens": 2}},
        postprocess=lambda row: row)  # a pass-through
    [row] = processor(ray.data.from_items([{"text": "Hi"}])).take_all()
    assert row["__inference_error__"] == ""


def test_an_error_row_says_type_and_message_and_skips_postprocess(ray_cluster, demo_path):
    config = vLLMEngineProcessorConfig(model_source=str(demo_path), engine_kwargs={"max_model_len": 64},
                                       batch_size=4, concurrency=1, should_continue_on_error=True,
                                       chat_template_stage=False)
    processor = build_processor(config, preprocess=lambda row: {"prompt": row["text"],
                                                               "sampling_params": {"max_tokens": 2}},
                                postprocess=lambda row: {"answer": row["generated_text"]})
    out = processor(ray.data.from_items([{"text": "Hi"}, {"text": "word " * 200}])).take_all()
    errors = [row for row in out if row.get("__inference_error__")]
    [error] = errors
    assert error["__inference_error__"].startswith("RequestError: prompt has ")
    assert error.get("answer") is None and error["text"] == "word " * 200  # whole, postprocess skipped
    [good] = [row for row in out if row.get("answer") is not None]
    assert good["__inference_error__"] == ""
