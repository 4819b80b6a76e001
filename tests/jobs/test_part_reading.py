"""Input files scanned into parts and read back part by part: the same rows, in order, exact.

A job reads its input in parts (``scan_inputs``, ``JobInputs.read_part``), never whole. These
files are the ones whose line ends, encodings, quoting or layout could cut a part in the wrong
place or lose a row, and the ones pyarrow's fast readers get wrong.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen_data.jobs.inputs import scan_inputs


def _rows(path: Path, rows_per_part: int = 2, encoding: str = "utf-8", scratch: Path | None = None) -> list[dict]:
    inputs = scan_inputs([path], encoding, rows_per_part, scratch=scratch)
    rows = []
    for index, part in enumerate(inputs.parts):
        table = inputs.read_part(index)
        assert table.num_rows == part.num_rows
        rows += [{k: v for k, v in row.items() if v is not None} for row in table.to_pylist()]
    return rows


@pytest.mark.parametrize("rows_per_part", [1, 2, 3, 10])
def test_csv_line_ends_quotes_and_header(tmp_path, rows_per_part):
    cases = {
        b"id,text\r1,a\r2,b\r3,c\r": ["a", "b", "c"],  # old Mac line ends
        b'\xef\xbb\xbfid,text\r\n1,"a\r\nb"\r\n\r\n2,"x ""q"""\r\n3,c': ["a\r\nb", 'x "q"', "c"],
        b'id,text\n1,"line one\nline two"\n2,b\n3,c\n': ["line one\nline two", "b", "c"],
    }
    for i, (data, texts) in enumerate(cases.items()):
        path = tmp_path / f"{i}.csv"
        path.write_bytes(data)
        assert [r["text"] for r in _rows(path, rows_per_part)] == texts, data
        assert [r["id"] for r in _rows(path, rows_per_part)] == [1, 2, 3]


def test_a_header_only_csv_has_no_rows(tmp_path):
    path = tmp_path / "h.csv"
    path.write_text("id,text\n")
    assert _rows(path) == []


@pytest.mark.parametrize("rows_per_part", [1, 2, 4])
def test_jsonl_blank_lines_bom_crlf_and_a_last_line_without_end(tmp_path, rows_per_part):
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"a": 1}\r\n\r\n  \n{"a": 2}\r\n\n{"a": 3}')
    assert _rows(path, rows_per_part) == [{"a": 1}, {"a": 2}, {"a": 3}]


def test_lines_that_are_not_objects_are_error_rows_not_a_crash(tmp_path):
    # pyarrow's JSON reader crashes the process on a first line `null`, and reads a later one
    # as a row of nulls.
    path = tmp_path / "a.jsonl"
    path.write_text('null\n{"a": 1}\n[1, 2]\nnull\n')
    rows = _rows(path, 4)
    assert [r.get("__input_error__") for r in rows] == [
        "a.jsonl line 1: expected a JSON object, got null", None,
        "a.jsonl line 3: expected a JSON object, got an array", "a.jsonl line 4: expected a JSON object, got null"]
    assert rows[1]["a"] == 1


def test_lists_whose_first_item_is_null_keep_their_values(tmp_path):
    # pyarrow 26 reads [null, false] as [false, false] and [null, 1] as [1, 0].
    path = tmp_path / "a.jsonl"
    rows = [{"b": [None, False]}, {"b": [True]}, {"n": [None, 1], "s": {"t": [None, "x"]}}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = _rows(path, 3)
    assert got[0]["b"] == [None, False] and got[1]["b"] == [True]
    assert got[2]["n"] == [None, 1] and got[2]["s"] == {"t": [None, "x"]}


def test_utf16_is_read_through_a_utf8_copy(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes("".join(json.dumps({"a": t}, ensure_ascii=False) + "\n" for t in "éz€").encode("utf-16"))
    assert _rows(path, 2, "utf-16", scratch=tmp_path) == [{"a": "é"}, {"a": "z"}, {"a": "€"}]


@pytest.mark.parametrize("rows_per_part", [1, 3, 4, 7, 20])
def test_parquet_parts_across_row_groups(tmp_path, rows_per_part):
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"id": list(range(10))}), path, row_group_size=3)
    assert [r["id"] for r in _rows(path, rows_per_part)] == list(range(10))


def test_line_numbers_count_from_the_file_not_the_part(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2}\n{"a": \n{"a": 4}\n')
    rows = _rows(path, 1)
    assert rows[2]["__input_error__"].startswith("a.jsonl line 4: invalid JSON")
    csv_path = tmp_path / "b.csv"
    csv_path.write_text('id,text\n1,a\n2,"b\nc"\n3,x,y\n')
    assert _rows(csv_path, 1)[2]["__input_error__"].startswith("b.csv line 5: expected 2 fields")
