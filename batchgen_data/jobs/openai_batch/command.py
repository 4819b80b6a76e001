"""The ``run-batch`` subcommand's flags (``vllm run-batch``'s names) and its run."""

from __future__ import annotations

import argparse
from pathlib import Path

from batchgen_data.jobs.cli_flags import (
    STAGE_DEFAULTS,
    add_chat_template_flags,
    add_distributed_flags,
    add_engine_flags,
    add_job_flags,
    chat_template_fields,
    engine_config_from,
    job_spec_from,
)
from batchgen_data.operators.rows import STAGE_SAMPLING_DEFAULTS


def add_parser(sub) -> None:
    run = sub.add_parser("run-batch", help="an OpenAI Batch input file (JSONL) in, its output file out, "
                                           "as vllm run-batch", description=__doc__)
    run.add_argument("-i", "--input-file", type=Path, required=True,
                     help="an OpenAI Batch JSONL file (chat completions, completions, embeddings), or a "
                          "folder of them")
    run.add_argument("-o", "--output-file", type=Path, required=True,
                     help="the output JSONL file: one line per input line, in input order (OUTPUT.parts/ "
                          "holds the work until it is written; rerun the same command to resume)")
    run.add_argument("--model", default=STAGE_DEFAULTS["model"], help="'demo' (default) or a local checkpoint folder")
    run.add_argument("--served-model-name", nargs="+", default=None,
                     help="the model names lines may give in body.model (default: --model and its folder name)")
    run.add_argument("--max-tokens", type=int, default=STAGE_SAMPLING_DEFAULTS["max_tokens"],
                     help="max_tokens of lines whose body gives none (default %(default)s)")
    add_chat_template_flags(run)
    add_job_flags(run)
    run.add_argument("--overwrite", action="store_true",
                     help="write OUTPUT again though it exists, or start over where its work differs")
    run.add_argument("--keep-parts", action="store_true",
                     help="keep OUTPUT.parts/ (the rows and their Parquet parts) after writing OUTPUT")
    add_engine_flags(run)
    add_distributed_flags(run)


def run(args: argparse.Namespace):
    from batchgen_data.jobs.openai_batch.run_batch import BatchSpec, run_batch
    from batchgen_data.operators.rows import StageConfig

    stage = StageConfig(model=args.model, engine_config=engine_config_from(args), **chat_template_fields(args))
    job = job_spec_from(args, stage, input=args.input_file, output=args.output_file)
    spec = BatchSpec(job=job, max_tokens=args.max_tokens, served_model_names=tuple(args.served_model_name or ()),
                     keep_parts=args.keep_parts)
    summary = run_batch(spec)
    print(f"batchgen-data: {summary.num_requests} requests, {summary.num_failed} failed -> {args.output_file}")
    print(f"batchgen-data: usage: {summary.usage.describe()} -> {summary.usage_path}")
    return summary
