"""``batchgen-data run-batch``: an OpenAI Batch input file in, its output file out (as
``vllm run-batch``), with every guarantee of ``run``.

1. Every input line is read (``requests.read_line``) before the model loads: lines that are not
   requests, repeated ``custom_id``s, unsupported URLs or fields, another model, bad values are
   settled here as their output lines' errors. The valid lines become rows in
   ``OUTPUT.parts/generate.jsonl`` and ``embed.jsonl`` (one row per prompt, written the same
   way on every run, so a rerun finds the same job).
2. Each of the two runs as a ``run`` job (``runner.run_job``) into ``OUTPUT.parts/generate/``
   and ``embed/``: parts, manifest, lock, resume after Ctrl-C or ``kill -9``, Ray workers.
3. The output file is written from the input lines and the parts, streaming, in input order
   (one line per non-blank input line), to a temporary name and renamed; then
   ``OUTPUT.usage.json`` (the job's ``JobUsage`` and its request counts) and, unless
   ``keep_parts``, the work folder is removed.
"""

from __future__ import annotations

import contextlib
import filecmp
import json
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import pyarrow.parquet as pq

from batchgen_data.errors import ConfigError
from batchgen_data.jobs.files import OutputPathError, atomic_write_bytes, locked_output
from batchgen_data.jobs.inputs import InputFilesError, check_input, discover_inputs
from batchgen_data.jobs.job_spec import JobSpec
from batchgen_data.jobs.openai_batch.requests import EMBEDDINGS, BatchLine, LineError, read_line
from batchgen_data.jobs.openai_batch.responses import error_output, response_output
from batchgen_data.jobs.readers import input_kind
from batchgen_data.jobs.runner import run_job
from batchgen_data.jobs.usage import JobUsage

# Columns of the rows files besides the prompt and params ones: where each row's result goes.
LINE, INDEX = "openai_line", "openai_index"
_JSON_COLUMNS = ["messages", "sampling_params", "pooling_params"]
_RESULT_COLUMNS = [LINE, INDEX, "generated_text", "finish_reason", "num_input_tokens", "num_generated_tokens",
                   "num_cached_tokens", "logprobs", "embeddings", "__inference_error__"]


@dataclass(slots=True)
class BatchSpec:
    """A ``run-batch`` job. ``job`` is how its ``run`` jobs run: its ``input`` is the batch file
    (or a folder of them), its ``output`` the output file, its ``stage`` the model, engine and
    chat-template settings (the task and sampling params are set per line); ``max_tokens`` is
    for lines that give none."""

    job: JobSpec
    max_tokens: int = 16
    served_model_names: tuple[str, ...] = ()
    keep_parts: bool = False


@dataclass(slots=True)
class BatchSummary:
    num_requests: int = 0
    num_failed: int = 0  # lines whose output carries an error
    usage: JobUsage = field(default_factory=JobUsage)
    usage_path: Path | None = None


def work_folder(output: Path) -> Path:
    return output.with_name(output.name + ".parts")


def usage_path(output: Path) -> Path:
    return output.with_name(output.name + ".usage.json")


def run_batch(spec: BatchSpec) -> BatchSummary:
    start = time.perf_counter()
    output = spec.job.output
    files = _input_files(spec.job.input)
    if output.is_dir():
        raise OutputPathError(f"OUTPUT {output} is a folder; run-batch writes one JSONL file")
    work = work_folder(output)
    if output.exists() and not work.exists() and not spec.job.overwrite:
        raise OutputPathError(f"{output} exists; pass --overwrite to write it again")
    models = spec.served_model_names or _model_names(spec.job.stage.model)
    with locked_output(work):
        counts = _write_rows(files, work, models, spec.max_tokens)
        usage = JobUsage()
        for task, num_rows in counts.items():
            if num_rows:
                usage.add(run_job(_job(spec, work, task)).usage)
        summary = BatchSummary(usage=usage)
        _write_output(files, work, models, spec, summary)
    usage.wall_s = time.perf_counter() - start
    summary.usage_path = usage_path(output)
    atomic_write_bytes(summary.usage_path, (json.dumps(
        {"requests": summary.num_requests, "failed_requests": summary.num_failed, **usage.to_dict()},
        indent=2) + "\n").encode())
    if not spec.keep_parts:
        shutil.rmtree(work, ignore_errors=True)
    return summary


def _input_files(path: Path) -> list[Path]:
    """``run``'s discovery (a file, or a folder's entries but hidden ones), each a readable
    JSONL file, or every bad one listed."""
    files = discover_inputs(path)
    bad = [f"{f}: {reason}" for f in files
           if (reason := check_input(f) or (None if input_kind(f) == "jsonl" else "not a JSONL file")) is not None]
    if bad:
        raise InputFilesError("input files cannot be read:\n  " + "\n  ".join(bad))
    return files


def _model_names(model: str) -> tuple[str, ...]:
    """The ``model`` values a line may name: as given to ``--model``, and its folder's name."""
    names = [model, str(Path(model).expanduser())]
    if model != "demo":
        names.append(Path(model).name)
    return tuple(dict.fromkeys(names))


def _lines(files: list[Path], models: tuple[str, ...], max_tokens: int) -> Iterator[BatchLine]:
    """Every non-blank input line, read; a repeated ``custom_id`` is its line's error."""
    seen: set[str] = set()
    number = 0
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            for text in f:
                if not text.strip():
                    continue
                line = read_line(text, number, models, max_tokens)
                number += 1
                if line.custom_id is not None:
                    if line.custom_id in seen:
                        line.error = LineError(f"custom_id {line.custom_id!r} is repeated (an earlier line has it)",
                                               code="duplicate_custom_id")
                        line.rows, line.parsed = [], False
                    seen.add(line.custom_id)
                yield line


def _write_rows(files: list[Path], work: Path, models: tuple[str, ...], max_tokens: int) -> dict[str, int]:
    """The valid lines' rows into ``work/generate.jsonl`` and ``embed.jsonl``, streaming (to a
    temporary name, kept only where it differs: a rerun's files are the same files)."""
    counts = {"generate": 0, "embed": 0}
    tmp = {task: work / f".tmp-{task}.jsonl" for task in counts}
    with contextlib.ExitStack() as stack:
        outs = {task: stack.enter_context(open(path, "w", encoding="utf-8")) for task, path in tmp.items()}
        for line in _lines(files, models, max_tokens):
            task = "embed" if line.url == EMBEDDINGS else "generate"
            for index, row in enumerate(line.rows):
                record = {LINE: line.line, INDEX: index, "custom_id": line.custom_id, **row}
                outs[task].write(json.dumps(record, sort_keys=True, ensure_ascii=False) + "\n")
                counts[task] += 1
    for task, path in tmp.items():
        final = work / f"{task}.jsonl"
        if not counts[task]:
            final.unlink(missing_ok=True)
            path.unlink()
        elif final.is_file() and filecmp.cmp(path, final, shallow=False):
            path.unlink()
        else:
            os.replace(path, final)
    return counts


def _job(spec: BatchSpec, work: Path, task: str) -> JobSpec:
    stage = replace(spec.job.stage, task_type=task, prompt_column=None, prompt_template=None,
                    json_columns=_JSON_COLUMNS, should_continue_on_error=True)
    return replace(spec.job, input=work / f"{task}.jsonl", output=work / task, stage=stage, output_format="parquet",
                   encoding=None, skip_bad_files=False)


def _results(folder: Path) -> Iterator[dict]:
    """The rows of a task's parts, in input order."""
    for path in sorted(folder.glob("part-*.parquet")) if folder.is_dir() else ():
        table = pq.read_table(path)
        yield from table.select([c for c in _RESULT_COLUMNS if c in table.column_names]).to_pylist()


def _write_output(files: list[Path], work: Path, models: tuple[str, ...], spec: BatchSpec,
                  summary: BatchSummary) -> None:
    results = {"generate": _results(work / "generate"), "embed": _results(work / "embed")}
    output = spec.job.output
    job_id = output.name
    created = int(time.time())
    tmp = output.with_name(f".tmp-{output.name}")
    try:
        with open(tmp, "w", encoding="utf-8") as out:
            for line in _lines(files, models, spec.max_tokens):
                if line.error is not None:
                    record = error_output(line, job_id, line.error)
                else:
                    task = "embed" if line.url == EMBEDDINGS else "generate"
                    rows = [next(results[task]) for _ in line.rows]
                    if any(r[LINE] != line.line or r[INDEX] != i for i, r in enumerate(rows)):
                        raise ConfigError(f"{work} holds results of other input lines than line {line.line + 1}; "
                                          "rerun with --overwrite")
                    record = response_output(line, job_id, rows, created)
                summary.num_requests += 1
                summary.num_failed += record["error"] is not None or record["response"]["status_code"] != 200
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, output)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
