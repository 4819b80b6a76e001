"""The ``run-batch`` subcommand's flags (``vllm run-batch``'s names) and its run."""

from __future__ import annotations

import argparse
from pathlib import Path

from batchgen_data.jobs.cli_flags import (
    STAGE_DEFAULTS,
    add_distributed_flags,
    add_engine_flags,
    engine_config_from,
    read_template,
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
    run.add_argument("--chat-template", default=None, metavar="FILE|JINJA",
                     help="a chat template for chat lines, replacing the tokenizer's (a file, or its text)")
    run.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                     help='arguments for the chat template, e.g. \'{"enable_thinking": false}\'')
    run.add_argument("--rows-per-part", type=int, default=256, help="rows per part file (default %(default)s)")
    run.add_argument("--overwrite", action="store_true",
                     help="write OUTPUT again though it exists, or start over where its work differs")
    run.add_argument("--keep-parts", action="store_true",
                     help="keep OUTPUT.parts/ (the rows and their Parquet parts) after writing OUTPUT")
    add_engine_flags(run)
    add_distributed_flags(run)
    run.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace):
    from batchgen_data.engine.structured.params import parse_json_object
    from batchgen_data.errors import BatchGenError
    from batchgen_data.jobs.openai_batch.run_batch import BatchSpec, run_batch
    from batchgen_data.operators.rows import StageConfig

    if args.rows_per_part < 1 or args.workers < 1:
        raise BatchGenError(f"--rows-per-part and --workers must be >= 1, got {args.rows_per_part} and {args.workers}")
    stage = StageConfig(
        model=args.model, engine_config=engine_config_from(args),
        chat_template=read_template(args.chat_template),
        chat_template_kwargs=None if args.chat_template_kwargs is None else parse_json_object(
            args.chat_template_kwargs, "--chat-template-kwargs"))
    spec = BatchSpec(input=args.input_file, output=args.output_file, stage=stage, max_tokens=args.max_tokens,
                     served_model_names=tuple(args.served_model_name or ()), rows_per_part=args.rows_per_part,
                     workers=args.workers, address=args.address, batch_size=args.batch_size,
                     max_concurrent_batches=args.max_concurrent_batches, cpus_per_worker=args.cpus_per_worker,
                     show_progress=not args.no_progress, overwrite=args.overwrite, keep_parts=args.keep_parts)
    summary = run_batch(spec)
    print(f"batchgen-data: {summary.num_requests} requests, {summary.num_failed} failed -> {args.output_file}")
    print(f"batchgen-data: usage: {summary.usage.describe()} -> {summary.usage_path}")
    return summary
