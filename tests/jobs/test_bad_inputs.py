"""Bad input files and output paths get a clear answer, never a traceback (issue #18).

The CLI runs over the corpus in ``tests/data/bad_inputs/`` (written by its ``make_corpus.py``).
Each case checks the exit status, that no traceback is printed, the message, and that every
input line comes out exactly once, in order, with error rows exactly where the input is bad.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen_data import Engine, EngineConfig, SamplingParams
from batchgen_data.jobs.cli import main

CORPUS = Path(__file__).resolve().parents[1] / "data" / "bad_inputs"
MAX_TOKENS = 4
ARGS = ["--max-tokens", str(MAX_TOKENS), "--max-num-seqs", "32", "--no-progress"]


def _run(capsys, inp: Path, out: Path, *extra: str) -> tuple[int, str, str]:
    code = main(["run", str(inp), str(out), *ARGS, *extra])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return code, captured.out, captured.err


def _output(out: Path) -> list[dict]:
    return pa.concat_tables([pq.read_table(p) for p in sorted(out.glob("part-*.parquet"))]).to_pylist()


def _copy(tmp_path: Path, *names: str) -> Path:
    folder = tmp_path / "in"
    folder.mkdir()
    for name in names:
        source = CORPUS / name
        if source.is_dir():
            shutil.copytree(source, folder, dirs_exist_ok=True)
        else:
            shutil.copy(source, folder / name)
    return folder


@pytest.fixture(scope="module")
def reference(demo_path):
    """prompt -> the text a clean file's row gets (the CLI's engine settings, greedy)."""
    engine = Engine(demo_path, EngineConfig(max_num_seqs=32))

    def generate(prompts: list[str]) -> dict[str, str]:
        outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
        return dict(zip(prompts, (o.text for o in outs)))

    return generate


def test_malformed_lines_become_error_rows_and_the_others_run(tmp_path, capsys, reference):
    code, stdout, _ = _run(capsys, CORPUS / "malformed_line.jsonl", tmp_path / "out")
    assert code == 0 and "6 rows in 1 parts (0 already done), 2 error rows" in stdout
    rows = _output(tmp_path / "out")
    assert [r["id"] for r in rows] == [0, 1, None, 3, None, 5]  # one row per line, blank line none
    cut, array = rows[2], rows[4]
    assert cut["__inference_error__"].startswith("RowError: malformed_line.jsonl line 3: invalid JSON")
    assert cut["__raw_input__"] == '{"id": 2, "prompt": "Ticket 2: where is'
    assert array["__inference_error__"] == "RowError: malformed_line.jsonl line 6: expected a JSON object, got an array"
    assert array["__raw_input__"] == '["not", "an", "object"]' and array["finish_reason"] == "error"
    good = [r for r in rows if r["id"] is not None]
    expected = reference([r["prompt"] for r in good])
    assert all(r["__inference_error__"] is None and r["__raw_input__"] is None for r in good)
    assert [r["generated_text"] for r in good] == [expected[r["prompt"]] for r in good]
    assert "__input_error__" not in rows[0]  # the reason is in __inference_error__, once


def test_mixed_types_in_a_column_reach_row_validation(tmp_path, capsys):
    code, stdout, _ = _run(capsys, CORPUS / "mixed_types", tmp_path / "out")
    assert code == 0 and "10 rows" in stdout and "4 error rows" in stdout
    rows = {r["id"]: r for r in _output(tmp_path / "out")}
    assert set(rows) == {"m0", "m1", "m2", "m3", "t0", "t1", "t2", "s0", "s1", "s2"}
    errors = {i: r["__inference_error__"] for i, r in rows.items() if r["__inference_error__"]}
    assert errors == {
        "m1": "RowError: column 'messages': messages must be a list of {role, content} objects, got str",
        "m2": "RowError: column 'messages': messages must be a list of {role, content} objects, got dict",
        "t1": "RequestError: token ids must be integers, got 'eleven' (str)",
        "s1": "RowError: sampling_params must be a dict, got str",
    }
    assert all(rows[i]["generated_text"] for i in rows if i not in errors)
    # The row's own sampling_params applied (decoded from the JSON text the column keeps).
    assert rows["s0"]["sampling_params"] == '{"max_tokens": 2}' and rows["s0"]["num_generated_tokens"] <= 2
    assert rows["s2"]["num_generated_tokens"] == MAX_TOKENS


def test_a_bad_byte_spoils_only_its_row(tmp_path, capsys, reference):
    code, stdout, _ = _run(capsys, CORPUS / "bad_byte.csv", tmp_path / "out")
    assert code == 0 and "4 rows" in stdout and "1 error rows" in stdout
    rows = _output(tmp_path / "out")
    assert [r["id"] for r in rows] == [0, 1, 2, 3]
    bad = rows[2]
    assert bad["__inference_error__"].startswith("RowError: bad_byte.csv line 4: invalid utf-8 bytes")
    assert bad["prompt"] == "Ticket 2: caf\ufffd machine leaks." and bad["generated_text"] == ""
    good = [r for r in rows if r["id"] != 2]
    expected = reference([r["prompt"] for r in good])
    assert all(r["__inference_error__"] is None for r in good)
    assert [r["generated_text"] for r in good] == [expected[r["prompt"]] for r in good]


def test_encoding_option_reads_latin1_text(tmp_path, capsys):
    from batchgen_data.jobs.readers import read_input

    assert read_input(CORPUS / "latin1.csv").table.column("__input_error__").null_count == 0  # all rows flagged
    code, stdout, _ = _run(capsys, CORPUS / "latin1.csv", tmp_path / "out", "--encoding", "latin-1")
    assert code == 0 and "2 rows" in stdout and "0 error rows" in stdout
    assert [r["prompt"] for r in _output(tmp_path / "out")] == [
        "Ticket 0: the café machine leaks.", "Ticket 1: naïve question."]
    code, _, stderr = _run(capsys, CORPUS / "latin1.csv", tmp_path / "out2", "--encoding", "klingon")
    assert code == 2 and "unknown encoding 'klingon'" in stderr


def test_csv_bom_repeated_names_and_a_row_with_too_many_fields(tmp_path, capsys):
    folder = _copy(tmp_path, "bom.csv", "bom.jsonl", "duplicate_columns.csv", "wrong_field_count.csv")
    code, stdout, _ = _run(capsys, folder, tmp_path / "out")
    assert code == 0 and "8 rows" in stdout and "1 error rows" in stdout
    rows = _output(tmp_path / "out")
    assert list(rows[0])[:6] == ["id", "note", "note.1", "__raw_input__", "generated_text", "generated_tokens"]
    assert [r["id"] for r in rows] == [0, 0, 1, 0, 1, 0, None, 2]  # files in name order, lines in order
    assert [(r["note"], r["note.1"]) for r in rows[3:5]] == [("first", "second"), ("third", "fourth")]
    assert rows[6]["__inference_error__"] == "RowError: wrong_field_count.csv line 3: expected 2 fields (as in the header), got 3 fields"
    assert rows[6]["__raw_input__"] == "1,Ticket 1: broken,very"


def test_empty_files_are_zero_rows_not_errors(tmp_path, capsys):
    folder = _copy(tmp_path, "empty.jsonl", "zero_rows.parquet")
    code, stdout, _ = _run(capsys, folder, tmp_path / "out")
    assert code == 0 and "0 rows in 0 parts" in stdout
    assert f"{folder / 'empty.jsonl'} has zero rows" in stdout and f"{folder / 'zero_rows.parquet'} has zero rows" in stdout


def test_unreadable_files_stop_the_job_before_any_work(tmp_path, capsys):
    folder = _copy(tmp_path, "folder_with_bad_files")
    (folder / "gone.jsonl").symlink_to(tmp_path / "deleted.jsonl")  # a dangling link: cannot be opened
    code, _, stderr = _run(capsys, folder, tmp_path / "out")
    assert code == 2
    assert "3 of 4 input files cannot be read; nothing was generated" in stderr and "--skip-bad-files" in stderr
    assert f"{folder / 'broken.parquet'}: cannot read it (Parquet magic bytes not found in footer" in stderr
    assert f"{folder / 'notes.txt'}: unsupported file type '.txt'" in stderr
    assert f"{folder / 'gone.jsonl'}: cannot read it (No such file or directory)" in stderr
    assert "_SUCCESS" not in stderr and ".crc" not in stderr  # writers' markers are not input
    assert not (tmp_path / "out").exists()
    code, _, stderr = _run(capsys, CORPUS / "truncated.parquet", tmp_path / "out")
    assert code == 2 and "1 of 1 input files cannot be read" in stderr


def test_skip_bad_files_runs_the_rest_and_a_rerun_picks_up_a_fixed_file(tmp_path, capsys):
    folder, out = _copy(tmp_path, "folder_with_bad_files"), tmp_path / "out"
    code, stdout, _ = _run(capsys, folder, out, "--skip-bad-files")
    assert code == 0 and "3 rows in 1 parts" in stdout and "skipped 2 input files" in stdout
    skipped = json.loads((out / "_skipped.json").read_text())
    assert [(Path(s["file"]).name, s["reason"][:30]) for s in skipped] == [
        ("broken.parquet", "cannot read it (Parquet magic "), ("notes.txt", "unsupported file type '.txt'; ")]
    assert [r["id"] for r in _output(out)] == [0, 1, 2]
    # The writer finished broken.parquet: a rerun processes it, and only it.
    pq.write_table(pa.table({"id": [10, 11], "prompt": ["Ticket 10: late.", "Ticket 11: lost."]}), folder / "broken.parquet")
    code, stdout, _ = _run(capsys, folder, out, "--skip-bad-files")
    assert code == 0 and "5 rows in 2 parts (1 already done)" in stdout and "skipped 1 input files" in stdout
    assert sorted(r["id"] for r in _output(out)) == [0, 1, 2, 10, 11]
    assert [s["file"] for s in json.loads((out / "_skipped.json").read_text())] == [str(folder / "notes.txt")]
    code, _, stderr = _run(capsys, folder, out)  # without the flag, the bad file still stops the job
    assert code == 2 and "1 of 3 input files cannot be read" in stderr


def test_a_folder_of_mixed_formats_and_columns_gets_one_schema(tmp_path, capsys):
    out = tmp_path / "out"
    code, stdout, _ = _run(capsys, CORPUS / "mixed_folder", out, "--rows-per-part", "2")
    assert code == 0 and "5 rows in 3 parts" in stdout and "0 error rows" in stdout
    schemas = {pq.read_schema(p) for p in out.glob("part-*.parquet")}
    assert len(schemas) == 1
    rows = _output(out)
    # `id` is a number in a.parquet and text in b.jsonl: stored as JSON text; score promotes to float.
    assert [(r["id"], r["score"]) for r in rows] == [("0", 0.0), ("1", 1.0), ("2", 2.0), ('"b0"', 0.5), ('"b1"', 1.5)]
    assert all(r["generated_text"] for r in rows)  # prompts from `prompt` in one file, `messages` in the other


@pytest.mark.parametrize("case", ["file", "under_a_file", "foreign_parts", "other_job"])
def test_output_path_problems_are_one_line_errors_before_any_work(tmp_path, capsys, case):
    out = tmp_path / "out"
    if case in ("file", "under_a_file"):
        out.write_text("not a folder")
        out = out / "sub" if case == "under_a_file" else out
    elif case == "foreign_parts":
        out.mkdir()
        (out / "part-00000-000000000.parquet").write_bytes(b"")
    else:
        assert _run(capsys, CORPUS / "empty.jsonl", out)[0] == 0
    code, _, stderr = _run(capsys, CORPUS / "bom.jsonl", out)
    expected = {"file": "is a file, not a folder", "under_a_file": f"{tmp_path / 'out'} is a file, not a folder",
                "foreign_parts": "holds part files but no _batchgen_job.json",
                "other_job": "holds parts of a different job (input files ['empty.jsonl'] then, ['bom.jsonl'] now)"}
    assert code == 2 and expected[case] in stderr and stderr.count("\n") == 1


def _write_200_rows(path: Path) -> int:
    """200 lines: tickets, with a cut-short line and a bad byte every 50 lines."""
    lines = []
    for i in range(200):
        if i % 50 == 7:
            lines.append(b'{"id": %d, "prompt": "cut' % i)
        elif i % 50 == 31:
            lines.append(b'{"id": %d, "prompt": "caf\xe9 %d"}' % (i, i))
        else:
            lines.append(json.dumps({"id": i, "prompt": f"Ticket {i}: order {i * 7} is late."}).encode())
    path.write_bytes(b"\n".join(lines) + b"\n")
    return len(lines)


@pytest.mark.timeout(240)
def test_sigint_then_rerun_gives_every_line_exactly_once(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    num_lines = _write_200_rows(inp)
    command = [sys.executable, "-m", "batchgen_data.jobs.cli", "run", str(inp), str(out), *ARGS, "--rows-per-part", "10"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ),
                            start_new_session=True)
    try:
        time.sleep(3)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode in (130, 0) and b"Traceback" not in stderr, stderr.decode()[-2000:]
        rerun = subprocess.run(command, capture_output=True, timeout=180, env=dict(os.environ))
        assert rerun.returncode == 0 and b"Traceback" not in rerun.stderr, rerun.stderr.decode()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    rows = _output(out)
    assert len(rows) == num_lines
    errors = {i: r["__inference_error__"] for i, r in enumerate(rows) if r["__inference_error__"]}
    assert sorted(errors) == [7, 31, 57, 81, 107, 131, 157, 181]
    assert errors[57].startswith("RowError: in.jsonl line 58: invalid JSON")
    assert errors[81].startswith("RowError: in.jsonl line 82: invalid utf-8 bytes")
    assert [r["id"] for i, r in enumerate(rows) if i not in errors or i % 50 == 31] == [
        i for i in range(200) if i % 50 != 7]  # every good line once, in input order


def test_a_lone_surrogate_spoils_only_its_row(tmp_path, capsys, reference):
    """Half an emoji (issue #31): ``\\ud83d`` alone is valid JSON but no text; its row is an error
    row with U+FFFD in its place, and every other row of the file runs."""
    lines = [
        '{"id": 0, "prompt": "Ticket 0: my parcel arrived late."}',
        r'{"id": 1, "prompt": "broken emoji \ud83d here"}',
        r'{"id": 2, "prompt": "a whole emoji \ud83d\ude00 is fine"}',
        r'{"id": 3, "prompt": "Ticket 3: lost.", "sampling_params": {"stop": ["\udc00"]}}',
        '{"id": 4, "prompt": "Ticket 4: broken."}',
    ]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    code, stdout, _ = _run(capsys, tmp_path / "in.jsonl", tmp_path / "out")
    assert code == 0 and "5 rows in 1 parts (0 already done), 2 error rows" in stdout
    rows = _output(tmp_path / "out")
    assert [r["id"] for r in rows] == [0, 1, 2, 3, 4]
    half, stop = rows[1], rows[3]
    assert half["__inference_error__"] == (
        "RowError: in.jsonl line 2: field 'prompt' holds a lone surrogate \\ud83d (half of a UTF-16 pair, "
        "such as a cut emoji), read as U+FFFD")
    assert half["prompt"] == "broken emoji \ufffd here" and half["__raw_input__"] == lines[1]
    assert half["generated_text"] == "" and half["finish_reason"] == "error"
    assert stop["__inference_error__"].startswith(
        "RowError: in.jsonl line 4: field 'sampling_params.stop[0]' holds a lone surrogate \\udc00")
    assert stop["sampling_params"] == {"stop": ["\ufffd"]}
    good = [rows[i] for i in (0, 2, 4)]
    assert good[1]["prompt"] == "a whole emoji \U0001f600 is fine"
    expected = reference([r["prompt"] for r in good])
    assert all(r["__inference_error__"] is None for r in good)
    assert [r["generated_text"] for r in good] == [expected[r["prompt"]] for r in good]
