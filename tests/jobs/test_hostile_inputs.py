"""The CLI against the files and habits users really have: nothing lost, nothing changed, nothing hung.

Each test is one finding of a hostile probe of the CLI (issue #50), run as real files through
``batchgen-data run``: two jobs on one OUTPUT, values nested deeper than Parquet allows, integers
beyond 2**53 beside floats, reruns with other options or edited inputs, one impossible token id,
FIFOs and devices among the inputs, 10,000 columns, a full disk, OUTPUT inside INPUT, input
columns named like output columns.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen_data.jobs.cli import main

ENGINE_ARGS = ["--max-num-seqs", "32", "--no-progress"]
BIG = 9007199254740993  # 2**53 + 1: the first integer a double cannot hold


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _read_output(folder: Path) -> list[dict]:
    rows = []
    for path in sorted(folder.glob("part-*")):
        if path.suffix == ".parquet":
            rows += pq.read_table(path).to_pylist()
        else:
            rows += [json.loads(line) for line in path.read_text().splitlines()]
    return rows


def _value(cell):
    """A cell as its input value: JSON-text columns hold the value's JSON."""
    return json.loads(cell) if isinstance(cell, str) else cell


def _nest(depth: int, kind: str = "list"):
    value = 1
    for _ in range(depth):
        value = [value] if kind == "list" else {"a": value}
    return value


def _cli(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "batchgen_data.jobs.cli", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ))


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.communicate()


def test_a_second_job_on_the_same_output_is_refused(tmp_path, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    _write_jsonl(inp, [{"id": i, "prompt": f"Ticket {i}: the order is late."} for i in range(120)])
    first = _cli(["run", str(inp), str(out), "--max-tokens", "12", "--rows-per-part", "8", *ENGINE_ARGS])
    try:
        deadline = time.time() + 60
        while not (out / ".batchgen.lock").is_file() or not (out / ".batchgen.lock").read_text().strip():
            assert first.poll() is None, first.communicate()
            assert time.time() < deadline, "the first job never locked OUTPUT"
            time.sleep(0.05)
        capsys.readouterr()
        assert main(["run", str(inp), str(out), "--max-tokens", "12", "--rows-per-part", "5", *ENGINE_ARGS]) == 2
        err = capsys.readouterr().err
        assert "in use by another batchgen-data job" in err and f"pid {first.pid}" in err
        assert len(err.strip().splitlines()) == 1
        _, stderr = first.communicate(timeout=240)
        assert first.returncode == 0, stderr.decode()[-2000:]
    finally:
        _stop(first)
    ids = [r["id"] for r in _read_output(out)]
    assert sorted(ids) == list(range(120))  # every row exactly once
    # The lock died with the first job: a rerun takes it, finds every part done.
    assert main(["run", str(inp), str(out), "--max-tokens", "12", "--rows-per-part", "8", *ENGINE_ARGS]) == 0
    assert "(15 already done)" in capsys.readouterr().out
    assert sorted(r["id"] for r in _read_output(out)) == list(range(120))


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_values_nested_deeper_than_parquet_allows_come_back_readable(tmp_path, fmt):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    rows = [{"id": 0, "prompt": "Hello there.", "deep": _nest(120, "object"), "lists": _nest(60), "meta": {"a": [1, 2]}},
            {"id": 1, "prompt": "Hello again.", "deep": None, "lists": None, "meta": {"a": []}}]
    _write_jsonl(inp, rows)
    assert main(["run", str(inp), str(out), "--max-tokens", "2", "--output-format", fmt, *ENGINE_ARGS]) == 0
    got = sorted(_read_output(out), key=lambda r: r["id"])
    if fmt == "parquet":
        import datasets

        assert datasets.load_dataset("parquet", data_files=str(out / "part-*.parquet"), split="train").num_rows == 2
    for name in ("deep", "lists"):  # one type in every row, too deep for Parquet: JSON text
        assert [r[name] if r[name] is None else json.loads(r[name]) for r in got] == [r[name] for r in rows]
    assert [r["meta"] for r in got] == [r["meta"] for r in rows]  # shallow columns stay typed
    assert all(r["__inference_error__"] is None for r in got)


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_integers_beyond_2_to_53_come_back_exactly(tmp_path, fmt):
    inp, out = tmp_path / "in", tmp_path / "out"
    inp.mkdir()
    # One file: ints and floats in one column, and an int beyond int64.
    _write_jsonl(inp / "a.jsonl", [
        {"user_id": BIG, "score": 1, "prompt": "First."},
        {"user_id": 1.5, "score": 2.5, "prompt": "Second."},
        {"user_id": 1234567890123456789, "score": 2**70, "prompt": "Third."},
    ])
    # A CSV file whose id column mixes long integers and floats.
    (inp / "b.csv").write_text(f"user_id,score,prompt\n{BIG},0.5,Fourth.\n2.25,{2**70},Fifth.\n")
    # Across files: exact int64 ids in Parquet, floats in the next file.
    pq.write_table(pa.table({"user_id": pa.array([BIG + 2], pa.int64()), "score": [7], "prompt": ["Sixth."]}),
                   inp / "c.parquet")
    _write_jsonl(inp / "d.jsonl", [{"user_id": 0.25, "score": 3, "prompt": "Seventh."}])
    assert main(["run", str(inp), str(out), "--max-tokens", "2", "--output-format", fmt, *ENGINE_ARGS]) == 0
    got = {r["prompt"]: r for r in _read_output(out)}
    want = {"First.": (BIG, 1), "Second.": (1.5, 2.5), "Third.": (1234567890123456789, 2**70),
            "Fourth.": (BIG, 0.5), "Fifth.": (2.25, 2**70), "Sixth.": (BIG + 2, 7), "Seventh.": (0.25, 3)}
    for prompt, (user_id, score) in want.items():
        row = next(r for p, r in got.items() if p.endswith(prompt))
        assert _value(row["user_id"]) == user_id and _value(row["score"]) == score, row


def test_a_rerun_with_other_options_or_edited_input_is_refused(tmp_path, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    _write_jsonl(inp, [{"id": i, "prompt": f"Ticket {i}."} for i in range(4)])
    base = ["run", str(inp), str(out), "--rows-per-part", "2", *ENGINE_ARGS]
    assert main(base + ["--max-tokens", "3"]) == 0
    capsys.readouterr()
    for extra, named in ((["--max-tokens", "4"], "max_tokens 3 then, 4 now"),
                         (["--max-tokens", "3", "--temperature", "0.5"], "temperature"),
                         (["--max-tokens", "3", "--prompt-template", "Q: {prompt}"], "prompt_template"),
                         (["--max-tokens", "3", "--regex", "[a-z]+"], "structured_outputs")):
        assert main(base + extra) == 2
        err = capsys.readouterr().err
        assert named in err and "--overwrite" in err, err
    # The same size, other bytes.
    inp.write_text(inp.read_text().replace("Ticket 3", "Ticket 9"))
    assert main(base + ["--max-tokens", "3"]) == 2
    assert "input files changed since: ['in.jsonl']" in capsys.readouterr().err
    assert main(base + ["--max-tokens", "4", "--overwrite"]) == 0
    got = _read_output(out)
    assert sorted(r["id"] for r in got) == [0, 1, 2, 3]
    assert all(r["num_generated_tokens"] == 4 for r in got)
    assert any("Ticket 9" in r["prompt"] for r in got)


def test_an_impossible_token_id_fails_only_its_row(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    _write_jsonl(inp, [{"id": 0, "prompt_token_ids": [9707, 11, 1879]},
                       {"id": 1, "prompt_token_ids": [9707, 2**70]},
                       {"id": 2, "prompt_token_ids": [9707, 11]}])
    assert main(["run", str(inp), str(out), "--max-tokens", "2", *ENGINE_ARGS]) == 0
    got = {r["id"]: r for r in _read_output(out)}
    assert got[0]["__inference_error__"] is None and got[2]["__inference_error__"] is None
    assert got[0]["num_generated_tokens"] == 2
    assert str(2**70) in got[1]["__inference_error__"]


def test_fifos_and_devices_are_bad_files_not_hangs(tmp_path):
    inp, out = tmp_path / "in", tmp_path / "out"
    inp.mkdir()
    _write_jsonl(inp / "good.jsonl", [{"prompt": "Hello."}])
    os.mkfifo(inp / "pipe.jsonl")
    (inp / "zero.jsonl").symlink_to("/dev/zero")
    proc = subprocess.run([sys.executable, "-m", "batchgen_data.jobs.cli", "run", str(inp), str(out), *ENGINE_ARGS],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert proc.returncode == 2, proc.stderr
    assert "pipe.jsonl: not a regular file: a FIFO" in proc.stderr
    assert "zero.jsonl: not a regular file: a character device (through a link)" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()
    assert main(["run", str(inp), str(out), "--max-tokens", "2", "--skip-bad-files", *ENGINE_ARGS]) == 0
    assert len(_read_output(out)) == 1


def test_ten_thousand_columns_load_in_seconds(tmp_path):
    inp, out = tmp_path / "wide.jsonl", tmp_path / "out"
    _write_jsonl(inp, [{**{f"c{i}": i * r for i in range(10_000)}, "prompt": "Hi."} for r in range(3)])
    start = time.perf_counter()
    assert main(["run", str(inp), str(out), "--max-tokens", "1", *ENGINE_ARGS]) == 0
    elapsed = time.perf_counter() - start
    got = pq.read_table(next(out.glob("part-*")))
    assert got.column("c9999").to_pylist() == [0, 9999, 19998]
    # 03da581 took 99 s before the model loaded (quadratic column lookups); this job ran in ~6 s
    assert elapsed < 45, f"{elapsed:.1f} s for a job of 10,000 columns"


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs (root only: skipped where mounting is not allowed)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_full_disk_is_one_line_and_a_rerun_resumes(tmp_path, small_disk, capsys):
    inp, out = tmp_path / "in.jsonl", small_disk / "out"
    _write_jsonl(inp, [{"id": i, "prompt": f"Ticket {i}: " + "late " * 40} for i in range(40)])
    filler = small_disk / "filler"
    filler.write_bytes(b"\0" * (2 * 1024 * 1024 - 120 * 1024))  # leaves room for a few parts only
    args = ["run", str(inp), str(out), "--max-tokens", "2", "--rows-per-part", "4", *ENGINE_ARGS]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "No space left on device" in err and len(err.strip().splitlines()) == 1, err
    assert not list(out.glob(".tmp-*"))
    for part in out.glob("part-*"):  # what counts as done is whole
        assert pq.read_metadata(part).num_rows == 4
    filler.unlink()
    assert main(args) == 0
    assert sorted(r["id"] for r in _read_output(out)) == list(range(40))


def test_a_bad_prompt_template_field_is_an_error_row(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    _write_jsonl(inp, [{"text": "Hello."}])
    assert main(["run", str(inp), str(out), "--prompt-template", "{text.nope}", *ENGINE_ARGS]) == 0
    error = _read_output(out)[0]["__inference_error__"]
    assert error == "RowError: prompt_template could not be filled: AttributeError: 'str' object has no attribute 'nope'"


def test_output_inside_the_input_folder_is_refused(tmp_path, capsys):
    inp = tmp_path / "in"
    inp.mkdir()
    _write_jsonl(inp / "a.jsonl", [{"prompt": "Hello."}])
    assert main(["run", str(inp), str(inp / "out"), *ENGINE_ARGS]) == 2
    assert "is inside the input folder" in capsys.readouterr().err
    assert not (inp / "out").exists()


def test_input_columns_named_like_output_columns_are_refused(tmp_path, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    _write_jsonl(inp, [{"prompt": "Hello.", "generated_text": "mine", "metrics": 3}])
    assert main(["run", str(inp), str(out), *ENGINE_ARGS]) == 2
    err = capsys.readouterr().err
    assert "['generated_text', 'metrics']" in err and "would be overwritten" in err
    assert not out.exists()


def test_workers_keep_integers_exact_and_leave_no_temp_folder(tmp_path):
    import tempfile

    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    _write_jsonl(inp, [{"user_id": BIG + i if i % 2 else i + 0.5, "prompt": f"Ticket {i}."} for i in range(6)])
    before = set(Path(tempfile.gettempdir()).glob("batchgen-ray-*"))
    proc = subprocess.run(
        [sys.executable, "-m", "batchgen_data.jobs.cli", "run", str(inp), str(out), "--max-tokens", "2",
         "--rows-per-part", "2", "--workers", "2", "--batch-size", "2", *ENGINE_ARGS],
        capture_output=True, text=True, timeout=280, env=dict(os.environ), start_new_session=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = {r["prompt"]: _value(r["user_id"]) for r in _read_output(out)}
    assert got == {f"Ticket {i}.": BIG + i if i % 2 else i + 0.5 for i in range(6)}
    assert set(Path(tempfile.gettempdir()).glob("batchgen-ray-*")) == before
