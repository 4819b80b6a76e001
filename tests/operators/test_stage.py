"""The row pipeline both stages share, without an engine: prepare a batch, finish it."""

from __future__ import annotations

import pyarrow as pa
import pytest
from batchgen_data.operators.columns import RowResult
from batchgen_data.operators.rows import RowError, StageConfig, prepare_rows
from batchgen_data.operators.stage import finish_batch, prepare_batch
from stage_rows import BAD_ROWS, mixed_rows

from batchgen_data import SamplingParams
from batchgen_data.engine.outputs import GenerationOutput

BAD_IDS = {r["id"] for r in BAD_ROWS}


def _echo(prompt: str) -> RowResult:
    """What a fake engine answers for ``prompt``."""
    return RowResult.from_output(GenerationOutput(request_id=0, token_ids=[1, 2], text=f"echo {prompt}",
                                                  finish_reason="length", num_input_tokens=3,
                                                  num_generated_tokens=2))


@pytest.mark.parametrize("fmt", ["pyarrow", "dict"])
def test_results_and_error_rows_come_back_in_input_order(fmt):
    rows = mixed_rows()
    table = pa.Table.from_pylist(rows)
    batch = table if fmt == "pyarrow" else table.to_pydict()
    config = StageConfig(sampling_params={"max_tokens": 5})
    prepared = prepare_batch(batch, config)
    assert [rows[r.index]["id"] for r in prepared.valid_rows] == [
        r["id"] for r in rows if r["id"] not in BAD_IDS
    ]
    out = finish_batch(prepared, [_echo(p) for p in prepared.prompts], config)
    out_rows = out.to_pylist() if fmt == "pyarrow" else pa.Table.from_pydict(out).to_pylist()
    assert [r["id"] for r in out_rows] == [r["id"] for r in rows]
    for row, out_row in zip(rows, out_rows):
        if row["id"] in BAD_IDS:
            assert out_row["finish_reason"] == "error" and out_row["__inference_error__"]
            assert out_row["generated_text"] == "" and out_row["generated_tokens"] == []
        else:
            assert out_row["generated_text"] == f"echo {row['prompt']}"
            assert out_row["__inference_error__"] is None


def test_an_all_error_batch_needs_no_results():
    config = StageConfig()
    prepared = prepare_batch({"prompt": ["", None]}, config)
    assert prepared.valid_rows == []
    out = finish_batch(prepared, [], config)
    assert out["finish_reason"] == ["error", "error"]


def test_should_continue_on_error_false_raises_for_bad_rows_and_failed_requests():
    config = StageConfig(should_continue_on_error=False)
    prepared = prepare_batch({"prompt": ["fine", ""]}, config)
    with pytest.raises(RowError, match="row 1 failed: RowError: empty prompt"):
        finish_batch(prepared, [_echo("fine")], config)
    prepared = prepare_batch({"prompt": ["fine", "too long"]}, config)
    with pytest.raises(RowError, match="row 1 failed: prompt too long"):
        finish_batch(prepared, [_echo("fine"), RowResult.failed("prompt too long")], config)


def test_stage_defaults_are_vllms_except_greedy():
    # Rows without sampling_params get SamplingParams' defaults (max_tokens 16), sampled greedily.
    assert StageConfig().default_params() == SamplingParams(temperature=0.0)
    assert StageConfig().sampling_params.max_tokens == SamplingParams().max_tokens == 16
    prepared = prepare_rows({"prompt": ["a"], "sampling_params": [{"top_k": 5}]}, 1, StageConfig())
    assert prepared[0].params == SamplingParams(temperature=0.0, top_k=5)


def test_integral_floats_from_pandas_become_ints():
    # pandas hands nullable ints inside structs over as floats.
    values = {"max_tokens": 3.0, "top_k": 2.0, "seed": 7.0, "stop_token_ids": [5.0], "top_p": 1.0}
    prepared = prepare_rows({"prompt": ["a"], "sampling_params": [values]}, 1, StageConfig())
    params = prepared[0].params
    assert (params.max_tokens, params.top_k, params.seed, params.stop_token_ids) == (3, 2, 7, [5])
    assert all(type(v) is int for v in (params.max_tokens, params.top_k, params.seed))
