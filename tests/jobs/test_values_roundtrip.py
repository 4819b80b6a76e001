"""Every value of a random typed table comes back equal through the job's files (issue #50).

Hypothesis writes tables nobody here designed: integers beyond 2**53 and beyond int64, floats,
columns mixing them, strings, structs and lists nested up to 70 deep, nulls, columns that only
some rows have, across several files. They go through what a CLI job does to its input values:
the scan into parts, each part read and conformed to the job's schema, written as a part
(Parquet and JSONL) and read back. JSON-text columns hold the value's JSON.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchgen_data.jobs.files import write_part
from batchgen_data.jobs.inputs import scan_inputs

INTEGERS = st.one_of(st.integers(-(2**53), 2**53), st.integers(-(2**80), 2**80),
                     st.sampled_from([2**53 + 1, -(2**53) - 1, 2**63 - 1, 2**63, 2**64 - 1, 1234567890123456789]))
FLOATS = st.floats(allow_nan=False, allow_infinity=False)
SCALARS = st.one_of(st.none(), st.booleans(), INTEGERS, FLOATS, st.text(max_size=8))


def _deep(depth: int, leaf):
    for _ in range(depth):
        leaf = [leaf]
    return leaf


VALUES = st.one_of(
    SCALARS,
    st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                  st.dictionaries(st.sampled_from("abc"), inner, max_size=3)),
                 max_leaves=6),
    st.builds(_deep, st.integers(40, 70), INTEGERS),
)
COLUMN_NAMES = st.sampled_from(["id", "score", "meta", "tags", "x"])
ROWS = st.lists(st.dictionaries(COLUMN_NAMES, VALUES, max_size=4), min_size=1, max_size=6)


def _normal(value):
    """The value as a reader may give it back: struct fields missing in a row come back null."""
    if isinstance(value, dict):
        return {k: _normal(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_normal(v) for v in value]
    return value


def _same(got, want) -> bool:
    """Equal values (ints and floats compare exactly in Python: 2**53 + 1 != 2.0**53); a float
    column may give an integer back as a float of the same value."""
    got, want = _normal(got), _normal(want)
    if isinstance(want, bool) or isinstance(got, bool):
        return got is want or got == want and type(got) is type(want)
    if isinstance(want, (int, float)) and isinstance(got, (int, float)):
        return got == want and (not isinstance(got, float) or math.isfinite(got))
    if isinstance(want, list) and isinstance(got, list):
        return len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want))
    if isinstance(want, dict) and isinstance(got, dict):
        return got.keys() == want.keys() and all(_same(got[k], want[k]) for k in want)
    return got == want


def _read_back(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow, HealthCheck.data_too_large])
@given(files=st.lists(ROWS, min_size=1, max_size=3), rows_per_part=st.integers(1, 4),
       parquet_file=st.booleans())
def test_every_value_comes_back_equal(tmp_path_factory, files, rows_per_part, parquet_file):
    folder = tmp_path_factory.mktemp("roundtrip")
    paths = []
    for i, rows in enumerate(files):
        rows = [{**row, "row": f"{i}-{k}"} for k, row in enumerate(rows)]
        files[i] = rows
        path = folder / f"in-{i}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        if parquet_file and i == 0:  # one file as Parquet, where pyarrow can type it exactly
            try:
                names = list(dict.fromkeys(k for row in rows for k in row))
                table = pa.table({name: [row.get(name) for row in rows] for name in names})
                pq.write_table(table, folder / "in-0.parquet")
                # pyarrow writes schemas it cannot read, and may change values it writes
                # ([0.0, False] as doubles): the file's own values are the input.
                files[0] = pq.read_table(folder / "in-0.parquet").to_pylist()
                path.unlink()
                path = folder / "in-0.parquet"
            except (pa.ArrowException, OSError, OverflowError, TypeError, ValueError):
                (folder / "in-0.parquet").unlink(missing_ok=True)
        paths.append(path)
    inputs = scan_inputs(paths, "utf-8", rows_per_part)
    json_columns = set(inputs.schema.json_columns)
    want = {row["row"]: row for rows in files for row in rows}
    for fmt in ("parquet", "jsonl"):
        out = folder / f"out-{fmt}"
        out.mkdir()
        got = []
        for index, part in enumerate(inputs.parts):
            got += _read_back(write_part(out, part, inputs.read_part(index), fmt))
        assert sorted(r["row"] for r in got) == sorted(want)
        for row in got:
            original = want[row["row"]]
            for name in inputs.schema.names:
                if name.startswith("__"):
                    continue
                value = row[name]
                if name in json_columns and value is not None:
                    value = json.loads(value)
                assert _same(value, original.get(name)), (fmt, name, value, original.get(name))
