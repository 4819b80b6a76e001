"""A grammar that fails to compile finishes its row as an error and never stalls the engine.

The repro of issue #31 defect 1: every row constrained by its own JSON schema, the first one
invalid. The failed sequence used to sit in a side list that made ``schedule()`` skip its wait
for the other rows' compiles and return an empty step, which the executor took for a stall
(``scheduler made no progress with unfinished requests``), killing the whole job.
"""

from __future__ import annotations

import json
import itertools

import pyarrow.parquet as pq
import pytest

from batchgen_data import Engine, EngineConfig, SamplingParams, StructuredOutputsParams
from batchgen_data.jobs.cli import main

BAD = {"type": "objekt"}
GOOD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
        "score": {"type": "integer", "minimum": 0, "maximum": 9},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "tags", "score", "ok"],
    "additionalProperties": False,
}


def _larger_schema(row: int) -> dict:
    """A valid schema per row, large enough to take a while to compile (and not cached across
    rows): the bad row's compile fails before these are ready, as in the reported job."""
    properties = {f"field_{row}_{i}": {"type": "string", "maxLength": 40 + i, "pattern": "^[a-z0-9 ]*$"}
                  for i in range(24)}
    return {"type": "object", "properties": {**GOOD["properties"], **properties},
            "required": list(GOOD["properties"]), "additionalProperties": False}


def _params(schema: dict, max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0,
                          structured_outputs=StructuredOutputsParams(json=schema))


def test_cli_job_whose_first_row_schema_is_invalid_runs_every_row(tmp_path):
    rows = [{"id": i, "prompt": f"Row {i}: extract the fields.",
             "sampling_params": {"max_tokens": 8, "structured_outputs": {"json": BAD if i == 0 else _larger_schema(i)}}}
            for i in range(6)]
    with open(tmp_path / "in.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    assert main(["run", str(tmp_path / "in.jsonl"), str(tmp_path / "out"), "--no-progress"]) == 0
    out = sorted((r for p in (tmp_path / "out").glob("part-*.parquet") for r in pq.read_table(p).to_pylist()),
                 key=lambda r: r["id"])
    assert [r["id"] for r in out] == list(range(6))
    assert out[0]["__inference_error__"] and "objekt" in out[0]["__inference_error__"]
    assert all(r["__inference_error__"] is None for r in out[1:])
    assert all(r["num_generated_tokens"] > 0 for r in out[1:])


@pytest.fixture(scope="module")
def engine(demo_path):
    return Engine(demo_path, EngineConfig(max_num_seqs=4))


@pytest.mark.parametrize("order", list(itertools.permutations(["bad", "good", "plain"])))
def test_every_admission_order_finishes_the_bad_row_as_an_error(engine, order):
    params = {"bad": _params(BAD), "good": _params(GOOD), "plain": SamplingParams(max_tokens=4, temperature=0)}
    outs = engine.generate([f"prompt {k}" for k in order], [params[k] for k in order])
    for kind, out in zip(order, outs):
        if kind == "bad":
            assert out.finish_reason == "error" and "objekt" in out.error
        else:
            assert out.error is None and out.num_generated_tokens > 0
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("num_bad", [1, 3])
def test_only_bad_grammars_finish_without_a_stall(engine, num_bad):
    outs = engine.generate([f"p{i}" for i in range(num_bad)], [_params(BAD)] * num_bad)
    assert all(o.finish_reason == "error" for o in outs)
