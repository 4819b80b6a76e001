"""The CLI batch job: run every pending part of the input through the engine, write parts.

Everything that can be checked is checked before the model loads: OUTPUT (``files.check_output``),
then every input file (``inputs.load_inputs``), so a bad path or file costs no engine start.
One worker runs an engine in this process and keeps several parts in flight so the running set
stays full across part boundaries. ``workers > 1`` runs ``BatchGenOperator`` actors through Ray
Data (a local Ray it starts, or ``address``) and writes each part when all its rows are back.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from batchgen_data.errors import ConfigError
from batchgen_data.jobs.files import (
    Part,
    check_output,
    clear_output,
    locked_output,
    open_output,
    read_manifest_path,
    remove_stale_temporaries,
    write_part,
)
from batchgen_data.jobs.inputs import BadInput, JobInputs, discover_inputs, scan_inputs
from batchgen_data.jobs.job_spec import JobSpec
from batchgen_data.jobs.interrupt import run_interruptible
from batchgen_data.jobs.manifest import JobManifest, job_options
from batchgen_data.jobs.progress import JobProgress
from batchgen_data.jobs.readers import resolve_encoding
from batchgen_data.jobs.usage import USAGE, JobUsage, usage_of_parts, write_usage
from batchgen_data.operators.columns import ERROR_COLUMN, OUTPUT_COLUMNS
from batchgen_data.operators.json_column import GENERATED_JSON_COLUMN
from batchgen_data.operators.rows import StageConfig

logger = logging.getLogger(__name__)

_PART_COLUMN, _ROW_COLUMN = "__batchgen_part", "__batchgen_row"


@dataclass(slots=True)
class JobSummary:
    num_parts: int
    num_parts_skipped: int
    num_rows: int
    num_error_rows: int = 0
    num_output_tokens: int = 0
    num_input_tokens: int = 0  # prompt tokens of the rows run in this invocation
    num_cached_tokens: int = 0  # of which their KV came from the prefix cache
    output_files: list[str] = field(default_factory=list)
    empty_inputs: list[str] = field(default_factory=list)  # files read with zero rows
    skipped_inputs: list[BadInput] = field(default_factory=list)  # bad files, with skip_bad_files
    usage: JobUsage | None = None  # the whole job's, written to OUTPUT/_usage.json once it is done

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Share of the prompt tokens run whose KV came from the prefix cache."""
        return self.num_cached_tokens / self.num_input_tokens if self.num_input_tokens else 0.0


def run_job(spec: JobSpec) -> JobSummary:
    start = time.perf_counter()
    encoding = resolve_encoding(spec.encoding)
    files = discover_inputs(spec.input)
    check_output(spec.output, spec.input)
    with locked_output(spec.output):
        if spec.overwrite:
            clear_output(spec.output)
        remove_stale_temporaries(spec.output)
        path = read_manifest_path(spec.output)
        previous = None if path is None else JobManifest.read(path)
        try:
            summary = _run_locked(spec, encoding, files, previous)
            summary.usage = usage_of_parts(spec.output)
            summary.usage.wall_s = time.perf_counter() - start
            summary.usage.run_completion_tokens = summary.num_output_tokens
            write_usage(spec.output / USAGE, summary.usage)
            return summary
        finally:
            remove_stale_temporaries(spec.output)  # UTF-8 copies of inputs in other encodings


def _run_locked(spec: JobSpec, encoding: str, files: list[Path], previous: JobManifest | None) -> JobSummary:
    manifest = JobManifest(inputs=[f.name for f in files], input_sizes=[_size(f) for f in files],
                           rows_per_part=spec.rows_per_part, output_format=spec.output_format, encoding=encoding,
                           options=job_options(spec.stage))
    inputs = scan_inputs(files, encoding, spec.rows_per_part, spec.skip_bad_files, scratch=spec.output)
    manifest.input_sha256 = inputs.sha256
    manifest.skipped = [Path(b.file).name for b in inputs.bad]
    manifest.columns = inputs.schema.column_types()
    if previous is not None:
        manifest.check_same_job(previous, spec.output)
        manifest.check_same_columns(previous, spec.output)
    _check_no_output_names(inputs, spec.stage)
    done = open_output(spec.output, manifest.to_json(), [asdict(b) for b in inputs.bad])
    pending = [i for i, p in enumerate(inputs.parts) if p.output_name(spec.output_format) not in done]
    summary = JobSummary(num_parts=len(inputs.parts), num_parts_skipped=len(inputs.parts) - len(pending),
                         num_rows=sum(p.num_rows for p in inputs.parts), empty_inputs=inputs.empty,
                         skipped_inputs=inputs.bad)
    # the stage's JSON-text columns (run-batch's rows) and those the reader found of mixed types
    json_columns = sorted(set(spec.stage.json_columns or ()) | set(inputs.schema.json_columns or ()))
    stage = replace(spec.stage, json_columns=json_columns or None)
    done_rows = summary.num_rows - sum(inputs.parts[i].num_rows for i in pending)
    progress = JobProgress(summary.num_rows, done_rows, spec.show_progress)
    try:
        if spec.workers <= 1:
            run_interruptible(_run_local(spec, stage, inputs, pending, progress, summary))
        else:
            _run_ray(spec, stage, inputs, pending, progress, summary)
    finally:
        progress.close()
    return summary


def _check_no_output_names(inputs: JobInputs, stage: StageConfig) -> None:
    """An input column the output would overwrite is an error naming it (the stage's own prompt
    columns are read, then written back rendered, as in Ray Data LLM)."""
    taken = (set(OUTPUT_COLUMNS) | {ERROR_COLUMN, GENERATED_JSON_COLUMN}) - {"prompt", "prompt_token_ids"}
    if stage.prompt_column is not None:
        taken.discard(stage.prompt_column)
    clashes = [name for name in inputs.schema.names if name in taken]
    if clashes:
        raise ConfigError(f"input columns {clashes} have the names of output columns and would be overwritten; "
                          "rename them in the input")


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:  # a broken link: reported as a bad file once the inputs are checked
        return -1


def _finish_part(spec: JobSpec, part: Part, table: pa.Table, progress: JobProgress, summary: JobSummary) -> None:
    path = write_part(spec.output, part, table, spec.output_format)
    num_errors = table.num_rows - table.column(ERROR_COLUMN).null_count
    tokens = sum(n or 0 for n in table.column("num_generated_tokens").to_pylist())
    summary.num_error_rows += num_errors
    summary.num_output_tokens += tokens
    summary.num_input_tokens += sum(n or 0 for n in table.column("num_input_tokens").to_pylist())
    summary.num_cached_tokens += sum(n or 0 for n in table.column("num_cached_tokens").to_pylist())
    summary.output_files.append(path.name)
    progress.update(table.num_rows, tokens, num_errors, summary.prefix_cache_hit_rate)


async def _run_local(spec, stage, inputs: JobInputs, pending: list[int], progress, summary) -> None:
    from batchgen_data.operators.ray_operator import BatchGenOperator

    if not pending:  # nothing to generate: no engine to load
        return
    operator = BatchGenOperator(**_operator_kwargs(stage))
    # Enough parts in flight to keep the engine's running set full across part boundaries; each
    # is read from its file only when a worker takes it, so memory holds these parts, not the input.
    in_flight = max(2, math.ceil(operator.engine.engine.max_running_seqs / spec.rows_per_part) + 1)
    queue = list(reversed(pending))

    async def worker() -> None:
        while queue:
            index = queue.pop()
            table = await asyncio.to_thread(inputs.read_part, index)
            _finish_part(spec, inputs.parts[index], await operator(table), progress, summary)

    try:
        await asyncio.gather(*(worker() for _ in range(in_flight)))
    finally:
        operator.engine.shutdown()


def _run_ray(spec, stage, inputs: JobInputs, pending: list[int], progress, summary) -> None:
    import ray

    from batchgen_data.operators.ray_operator import BatchGenOperator

    if not pending:
        return
    started = not ray.is_initialized()
    temp_dir = None
    if started:
        if spec.address:
            ray.init(address=spec.address, log_to_driver=False)
        else:
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            temp_dir = tempfile.mkdtemp(prefix="batchgen-ray-")
            ray.init(include_dashboard=False, log_to_driver=False, _temp_dir=temp_dir)
    try:
        total = ray.cluster_resources().get("CPU", 1)
        engine = stage.engine_config
        ranks = engine.expert_parallel_size if engine is not None else 1
        cpus = spec.cpus_per_worker
        if cpus is None and ranks > 1:
            cpus = 0.25  # the engine actor steers its rank actors, which do the compute
        elif cpus is None:
            # Leave a CPU for Ray Data's read and bookkeeping tasks: on small machines whole-CPU
            # actors starve them and the pipeline hangs without an error.
            cpus = max(0.25, min(1.0, (total - 1) / spec.workers))
        if ranks > 1 and engine.rank_resources is None and not spec.address:
            # The local Ray: the ranks share what the engine actors and Ray Data's tasks leave.
            share = max(0.1, int(20 * (total - 1 - spec.workers * cpus) / (spec.workers * ranks)) / 20)
            stage = replace(stage, engine_config=replace(engine, rank_resources={"CPU": share}))
        operator_kwargs = _operator_kwargs(stage)
        # The driver reads the pending parts and hands them to Ray's object store (which spills
        # to disk), so this process holds no more than the local run's parts in flight beyond
        # one part at a time; the blocks are the parts, tagged to be put back together.
        blocks = []
        for index, part_index in enumerate(pending):
            table = inputs.read_part(part_index)
            table = table.append_column(_PART_COLUMN, pa.array([index] * table.num_rows, pa.int64()))
            blocks.append(ray.put(table.append_column(_ROW_COLUMN, pa.array(range(table.num_rows), pa.int64()))))
        ds = ray.data.from_arrow_refs(blocks).map_batches(
            BatchGenOperator,
            fn_constructor_kwargs={**operator_kwargs, "max_concurrent_batches": spec.max_concurrent_batches},
            batch_size=spec.batch_size,
            batch_format="pyarrow",
            compute=ray.data.ActorPoolStrategy(size=spec.workers, max_concurrent_calls_per_actor=spec.max_concurrent_batches),
            num_cpus=cpus,
        )
        collected: dict[int, list[pa.Table]] = {}
        seen: dict[int, set[int]] = {}
        for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None):
            for index in set(batch.column(_PART_COLUMN).to_pylist()):
                rows = batch.filter(pc.equal(batch.column(_PART_COLUMN), index))
                part_seen = seen.setdefault(index, set())
                if part_seen:  # a retried task may hand rows back twice: keep the first copy
                    rows = rows.filter(pc.invert(pc.is_in(rows.column(_ROW_COLUMN), pa.array(sorted(part_seen)))))
                part_seen.update(rows.column(_ROW_COLUMN).to_pylist())
                collected.setdefault(index, []).append(rows)
                part = inputs.parts[pending[index]]
                if len(part_seen) == part.num_rows:
                    table = pa.concat_tables(collected.pop(index)).sort_by(_ROW_COLUMN)
                    _finish_part(spec, part, table.drop_columns([_PART_COLUMN, _ROW_COLUMN]), progress, summary)
        if collected:
            raise RuntimeError(f"{len(collected)} parts came back incomplete from Ray Data")
    finally:
        if started:
            ray.shutdown()
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)


def _operator_kwargs(stage: StageConfig) -> dict:
    """The stage config as ``BatchGenOperator`` keyword arguments (plain data, for Ray to ship)."""
    kwargs = {f: getattr(stage, f) for f in StageConfig.__dataclass_fields__}
    kwargs["sampling_params"] = stage.sampling_params.to_dict()
    if stage.engine_config is not None:
        kwargs["engine_config"] = asdict(stage.engine_config)
    return kwargs
