"""The CLI batch job: formats, error rows, exactly-once resume after kill -9 and Ctrl-C, Ray workers."""

from __future__ import annotations

import json
import os
import re
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

MAX_TOKENS = 6
ENGINE_ARGS = ["--max-num-seqs", "32", "--no-progress"]


def _rows(n: int, start: int = 0) -> list[dict]:
    rows = [{"id": i, "prompt": f"Ticket {i}: my order number {i * 7} arrived {'late' if i % 3 else 'broken'}."}
            for i in range(start, start + n)]
    return rows


def _write_inputs(folder: Path) -> list[dict]:
    folder.mkdir()
    a, b, c = _rows(10), _rows(7, start=10), _rows(5, start=17)
    b[2]["prompt"] = ""  # a bad row
    with open(folder / "a.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in a)
    pq.write_table(pa.Table.from_pylist(b), folder / "b.parquet")
    with open(folder / "c.csv", "w") as f:
        f.write("id,prompt\n" + "".join(f'{r["id"]},"{r["prompt"]}"\n' for r in c))
    return a + b + c


def _read_output(folder: Path) -> list[dict]:
    rows = []
    for path in sorted(folder.glob("part-*")):
        if path.suffix == ".parquet":
            rows += pq.read_table(path).to_pylist()
        else:
            rows += [json.loads(line) for line in path.read_text().splitlines()]
    return rows


@pytest.fixture(scope="module")
def reference(demo_path):
    engine = Engine(demo_path, EngineConfig(max_num_seqs=32))
    rows = _rows(60)
    outs = engine.generate([r["prompt"] for r in rows], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    return {r["id"]: o.text for r, o in zip(rows, outs)}


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_folder_of_mixed_formats_gives_one_row_per_row(tmp_path, reference, fmt):
    rows = _write_inputs(tmp_path / "in")
    out = tmp_path / "out"
    assert main(["run", str(tmp_path / "in"), str(out), "--max-tokens", str(MAX_TOKENS),
                 "--rows-per-part", "4", "--output-format", fmt, *ENGINE_ARGS]) == 0
    got = _read_output(out)
    assert sorted(r["id"] for r in got) == sorted(r["id"] for r in rows)
    for row in got:
        if row["id"] == 12:
            assert row["finish_reason"] == "error" and "empty prompt" in row["__inference_error__"]
        else:
            assert row["__inference_error__"] is None and row["generated_text"] == reference[row["id"]]
    assert all(p.suffix == f".{fmt}" for p in out.glob("part-*"))


def test_rerun_skips_done_parts_and_rejects_a_different_job(tmp_path, capsys):
    _write_inputs(tmp_path / "in")
    args = ["run", str(tmp_path / "in"), str(tmp_path / "out"), "--max-tokens", str(MAX_TOKENS), *ENGINE_ARGS]
    assert main(args + ["--rows-per-part", "4"]) == 0
    assert main(args + ["--rows-per-part", "4"]) == 0
    assert "(7 already done)" in capsys.readouterr().out
    assert main(args + ["--rows-per-part", "5"]) == 2
    assert "different job" in capsys.readouterr().err


def test_missing_input_is_a_clear_error(tmp_path, capsys):
    assert main(["run", str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    assert "does not exist" in capsys.readouterr().err


def _cli(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "batchgen_data.jobs.cli", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ))


def _wait_for_parts(out: Path, count: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while len(list(out.glob("part-*"))) < count:
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "no part appeared in time"
        time.sleep(0.2)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig,when", [(signal.SIGKILL, "parts"), (signal.SIGINT, "parts"), (signal.SIGINT, 0.3),
                                      (signal.SIGINT, 2.5)], ids=["kill-9", "ctrl-c-mid-job", "ctrl-c-at-start",
                                                                    "ctrl-c-while-loading"])
def test_interrupted_job_resumes_with_every_row_exactly_once(tmp_path, reference, sig, when):
    inp = tmp_path / "in.jsonl"
    rows = _rows(60)
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    args = ["run", str(inp), str(out), "--max-tokens", str(MAX_TOKENS), "--rows-per-part", "2", *ENGINE_ARGS,
            "--max-num-seqs", "4"]
    proc = _cli(args)
    if when == "parts":
        _wait_for_parts(out, 2, proc)
    else:  # seconds after the start: importing, reading the inputs, loading the model
        time.sleep(when)
    proc.send_signal(sig)
    proc.wait(timeout=60)
    if sig == signal.SIGINT:
        assert proc.returncode == 130, proc.communicate()
    done_before = len(list(out.glob("part-*")))
    assert done_before < 30, "the job should have been interrupted part-way"
    assert done_before > 0 or when != "parts"
    finished = _cli(args)
    stdout, stderr = finished.communicate(timeout=240)
    assert finished.returncode == 0, stderr.decode()
    assert f"({done_before} already done)" in stdout.decode()
    got = _read_output(out)
    assert sorted(r["id"] for r in got) == [r["id"] for r in rows]  # each row exactly once
    assert all(r["generated_text"] == reference[r["id"]] for r in got)
    assert not list(out.glob(".tmp-*"))


def test_ctrl_c_after_the_work_still_exits_130(monkeypatch, tmp_path):
    """A Ctrl-C that lands once the parts are written (while the summary is printed) is honoured."""
    from batchgen_data.jobs import runner

    real = runner.run_job

    def run_then_interrupt(spec):
        summary = real(spec)
        os.kill(os.getpid(), signal.SIGINT)  # delivered to the CLI's handler, in this main thread
        return summary

    monkeypatch.setattr(runner, "run_job", run_then_interrupt)
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt": "Hello"}) + "\n")
    # Whatever handled SIGINT before (Python's default, or SIG_IGN in a process started in the
    # background by a shell without job control) is back afterwards.
    before = signal.getsignal(signal.SIGINT)
    assert main(["run", str(tmp_path / "in.jsonl"), str(tmp_path / "out"), "--max-tokens", "2", *ENGINE_ARGS]) == 130
    assert signal.getsignal(signal.SIGINT) is before  # the CLI's handler is gone


_TRIAGE = ("You are a support triage assistant for an online shop. Read the customer ticket below and "
           "classify it as one of: delivery delay, damaged item, wrong item, refund request, other. Reply "
           "with the label only, in lower case, and nothing else. Ticket: {prompt}")


@pytest.mark.timeout(300)
def test_interrupted_templated_job_resumes_with_prefix_caching_and_the_uncached_tokens(tmp_path, demo_path):
    rows = _rows(24)
    engine = Engine(demo_path, EngineConfig(max_num_seqs=32, enable_prefix_caching=False))
    outs = engine.generate([_TRIAGE.format(prompt=r["prompt"]) for r in rows],
                           SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    expected = {r["id"]: o.text for r, o in zip(rows, outs)}
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    args = ["run", str(inp), str(out), "--max-tokens", str(MAX_TOKENS), "--rows-per-part", "4", "--no-progress",
            "--max-num-seqs", "4", "--prompt-template", _TRIAGE, "--output-format", "jsonl"]
    proc = _cli(args)
    _wait_for_parts(out, 2, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    done_before = len(list(out.glob("part-*")))
    assert 0 < done_before < 6, "the job should have been interrupted part-way"
    finished = _cli(args)
    stdout, stderr = finished.communicate(timeout=240)
    assert finished.returncode == 0, stderr.decode()
    assert "prefix cache hit" in stdout.decode()
    got = _read_output(out)
    assert sorted(r["id"] for r in got) == [r["id"] for r in rows]  # each row exactly once
    assert all(r["generated_text"] == expected[r["id"]] for r in got)
    assert sum(r["num_cached_tokens"] > 0 for r in got) >= len(rows) // 2  # the template was shared


@pytest.mark.timeout(300)
def test_ray_workers_give_the_same_rows_bad_lines_included(tmp_path, reference):
    """Ray Data joins blocks of different files into batches: the job gives them one schema."""
    inp = tmp_path / "in"
    inp.mkdir()
    rows = _rows(24)
    lines = [json.dumps({**r, "sampling_params": {"max_tokens": MAX_TOKENS}}) for r in rows[:11]]
    lines.append(json.dumps({**rows[11], "sampling_params": "max_tokens=2"}))  # mixed types: row 11's error
    lines.insert(5, '{"id": 99, "prompt": "cut short')  # line 6: an error row
    (inp / "a.jsonl").write_text("".join(line + "\n" for line in lines))
    pq.write_table(pa.Table.from_pylist([{**r, "source": "b"} for r in rows[12:]]), inp / "b.parquet")
    out = tmp_path / "out"
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    proc = subprocess.run(
        [sys.executable, "-m", "batchgen_data.jobs.cli", "run", str(inp), str(out), "--max-tokens", str(MAX_TOKENS),
         "--rows-per-part", "5", "--workers", "2", "--batch-size", "4", *ENGINE_ARGS],
        capture_output=True, env=env, timeout=280,
    )
    assert proc.returncode == 0 and b"Traceback" not in proc.stderr, proc.stderr.decode()[-3000:]
    got = _read_output(out)
    assert len(got) == 25 and sorted(r["id"] for r in got if r["id"] is not None) == [r["id"] for r in rows]
    errors = {r["id"]: r["__inference_error__"] for r in got if r["__inference_error__"]}
    assert errors == {None: "RowError: a.jsonl line 6: invalid JSON at column 22: Unterminated string",
                      11: "RowError: sampling_params must be a dict, got str"}
    assert all(r["generated_text"] == reference[r["id"]] for r in got if r["id"] not in errors)
    ids_by_part = {p.name: [r["id"] for r in pq.read_table(p).to_pylist()] for p in out.glob("part-*")}
    assert all(ids == sorted(ids) for ids in ids_by_part.values() if None not in ids)  # input order within a part
    assert ids_by_part["part-00000-000000005.parquet"] == [None, 5, 6, 7, 8]


def test_weight_memory_streams_experts_with_the_same_rows(tmp_path, reference, demo_path, capsys):
    engine = Engine(demo_path, EngineConfig(max_num_seqs=32))
    config = engine.executor.model.config
    per_expert = engine.executor.model.expert_store.nbytes // (len(engine.executor.model.expert_store.layer_ids()) * config.num_experts)
    minimum = engine.executor.model.dense_weight_bytes + config.num_experts_per_tok * per_expert
    rows = _write_inputs(tmp_path / "in")
    args = ["run", str(tmp_path / "in"), str(tmp_path / "out"), "--max-tokens", str(MAX_TOKENS), *ENGINE_ARGS]
    assert main(args + ["--weight-memory", f"{minimum - 1}B"]) == 2
    assert f"the minimum is {minimum} bytes" in capsys.readouterr().err
    assert main(args + ["--weight-memory", f"{minimum + per_expert}B"]) == 0
    got = {r["id"]: r for r in _read_output(tmp_path / "out")}
    assert sorted(got) == sorted(r["id"] for r in rows)
    assert all(r["generated_text"] == reference[i] for i, r in got.items() if i != 12)


def test_weight_memory_takes_units_and_rejects_ambiguous_ones(capsys):
    from batchgen_data.jobs.cli import build_parser

    assert build_parser().parse_args(["run", "in", "out", "--weight-memory", "512MiB"]).weight_memory == 512 << 20
    assert build_parser().parse_args(["run", "in", "out", "--weight-memory", "1.5GB"]).weight_memory == 1_500_000_000
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "in", "out", "--weight-memory", "8G"])
    assert "unknown unit 'G'" in capsys.readouterr().err


def test_sampling_flags_default_to_the_stages_defaults_and_say_so(capsys):
    from batchgen_data.jobs.cli import build_parser
    from batchgen_data.operators.rows import StageConfig

    args = build_parser().parse_args(["run", "in", "out"])
    stage = StageConfig()
    names = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos")
    assert {n: getattr(args, n) for n in names} == {n: getattr(stage.sampling_params, n) for n in names}
    engine = EngineConfig()  # the engine flags' defaults are EngineConfig's
    assert (args.device, args.dtype, args.max_num_seqs, args.expert_backend, args.expert_parallel_size,
            args.enable_prefix_caching, args.placement_strategy) == (
        engine.device, engine.dtype, engine.max_num_seqs, engine.expert_backend, engine.expert_parallel_size,
        engine.enable_prefix_caching, engine.placement_strategy)
    assert (args.model, args.task) == (stage.model, stage.task_type)
    assert args.max_tokens == SamplingParams().max_tokens  # vLLM's default, not a copy of it
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"most tokens to generate per row (default {SamplingParams().max_tokens})" in help_text


@pytest.mark.parametrize("flag", ["--json-schema", "--choice", "--regex"])
def test_structured_output_flags_and_the_typed_json_column(tmp_path, flag):
    from structured_rows import CHOICE, REGEX, SCHEMA, check_generated_json

    rows = [{"id": i, "prompt": f"Review {i}: the soup was {'cold' if i % 2 else 'great'}."} for i in range(6)]
    rows[2]["sampling_params"] = {"max_tokens": 1}  # cut short (a choice may take one token)
    with open(tmp_path / "in.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "schema.json").write_text(json.dumps(SCHEMA))
    value = {"--json-schema": str(tmp_path / "schema.json"), "--choice": ",".join(CHOICE), "--regex": REGEX}[flag]
    assert main(["run", str(tmp_path / "in.jsonl"), str(tmp_path / "out"), flag, value, "--disable-any-whitespace",
                 "--max-tokens", "48", *ENGINE_ARGS]) == 0
    out = sorted(_read_output(tmp_path / "out"), key=lambda r: r["id"])
    assert [r["id"] for r in out] == list(range(6))
    assert out[2]["finish_reason"] == "length" or flag == "--choice"
    stopped = [r for r in out if r["finish_reason"] == "stop"]
    assert len(stopped) >= 5
    if flag == "--json-schema":
        schema = pq.read_schema(next((tmp_path / "out").glob("part-*.parquet")))
        assert pa.types.is_struct(schema.field("generated_json").type)
        check_generated_json(out)
    else:
        assert "generated_json" not in out[0]
        assert all(r["generated_text"] in CHOICE if flag == "--choice" else re.fullmatch(REGEX, r["generated_text"])
                   for r in stopped)


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_logprobs_flags_fill_the_logprob_columns(tmp_path, fmt):
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(3)))
    assert main(["run", str(tmp_path / "in.jsonl"), str(tmp_path / "out"), "--logprobs", "2", "--prompt-logprobs", "0",
                 "--max-tokens", "3", "--output-format", fmt, *ENGINE_ARGS]) == 0
    for row in _read_output(tmp_path / "out"):
        entries = [{e["token_id"]: e for e in position} for position in row["logprobs"]]  # the token first
        assert [next(iter(e)) for e in entries] == row["generated_tokens"]
        assert all(len(e) in (2, 3) for e in entries)
        assert row["prompt_logprobs"][0] is None and len(row["prompt_logprobs"]) == row["num_input_tokens"]


def test_an_engine_that_dies_in_a_local_job_is_a_clear_error_not_a_silent_exit(tmp_path, monkeypatch, capsys):
    """Outside a Ray actor nobody restarts the process: the operator used to ``os._exit(1)`` on
    engine death (right for a Ray actor), which killed a local CLI run without a message."""
    from batchgen_data.engine.executor.in_process import InProcessExecutor

    def broken_step(self):
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(InProcessExecutor, "step", broken_step)
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(3)))
    assert main(["run", str(tmp_path / "in.jsonl"), str(tmp_path / "out"), *ENGINE_ARGS]) == 2
    assert "simulated kernel failure" in capsys.readouterr().err
