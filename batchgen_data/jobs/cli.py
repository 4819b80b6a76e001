"""``batchgen-data``: run a MoE model over a folder of Parquet / JSONL / CSV rows, or over an
OpenAI Batch file.

    batchgen-data run INPUT OUTPUT [--model PATH|demo] [--prompt-column COL]
                      [--task generate|embed|classify] [--max-tokens N] [--weight-memory SIZE]
                      [--workers N] [--address ADDR] ...
    batchgen-data run-batch -i BATCH.jsonl -o RESULTS.jsonl [--model PATH|demo] ...

Every job writes its token usage (rows, prompt, cached and completion tokens, error rows, wall
time, tokens/s) to OUTPUT/_usage.json (run-batch: RESULTS.jsonl.usage.json) and prints it.

--task embed writes each row's embedding (the last prompt token's final hidden state,
L2-normalized) to the embeddings column; --task classify writes the class probabilities of a
*ForSequenceClassification checkpoint's head there. Rows may carry a pooling_params column
(vLLM's PoolingParams names: dimensions, normalize, use_activation, truncate_prompt_tokens).

Interrupted (Ctrl-C, kill -9)? Run the same command again: finished parts are kept, the rest is
redone, and every input row comes out exactly once.

Bad input never ends in a traceback: a malformed line or a line with invalid bytes becomes an
error row; a file that cannot be read at all stops the job before anything is generated, listing
every such file (or, with --skip-bad-files, is skipped and listed in OUTPUT/_skipped.json).
Errors exit with status 2, Ctrl-C with 130.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
import threading
from pathlib import Path

from batchgen_data.config.tasks import TASK_TYPES
from batchgen_data.errors import BatchGenError
from batchgen_data.jobs.cli_flags import (
    STAGE_DEFAULTS,
    add_chat_template_flags,
    add_distributed_flags,
    add_engine_flags,
    add_job_flags,
    chat_template_fields,
    engine_config_from,
    job_spec_from,
    read_template,
)
from batchgen_data.jobs.openai_batch import command as run_batch_command
from batchgen_data.jobs.usage import USAGE
from batchgen_data.operators.rows import STAGE_SAMPLING_DEFAULTS

# The sampling flags (each a ``SamplingParams`` field of that name) that make up the job's
# default ``sampling_params``; ``--json-schema`` / ``--choice`` / ... add ``structured_outputs``.
_SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos",
                   "logprobs", "prompt_logprobs")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchgen-data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="generate for every row of INPUT into part files under OUTPUT")
    run.add_argument("input", type=Path, help="a .parquet/.jsonl/.csv file or a folder of them")
    run.add_argument("output", type=Path,
                     help="output folder (reused to resume an interrupted job)")
    run.add_argument("--model", default=STAGE_DEFAULTS["model"],
                     help="'demo' (default) or a local checkpoint folder")
    run.add_argument("--prompt-column", default=None,
                     help="column holding prompts (default: prompt, messages or prompt_token_ids)")
    run.add_argument("--task", choices=TASK_TYPES, default=STAGE_DEFAULTS["task_type"],
                     help="generate text (default), or embed / classify each row prefill-only into "
                          "the embeddings column (Ray Data LLM's task_type)")
    run.add_argument("--prompt-template", default=None,
                     help="build prompts from columns: a text with {column} placeholders, "
                          "or a file holding it")
    add_chat_template_flags(run)
    run.add_argument("--output-format", choices=("parquet", "jsonl"), default="parquet")
    add_job_flags(run)
    run.add_argument("--encoding", default=None,
                     help="text encoding of JSONL and CSV inputs (default utf-8; bad bytes mark "
                          "their row as an error)")
    run.add_argument("--overwrite", action="store_true",
                     help="start over in an OUTPUT folder holding another job's parts (removes them); "
                          "without it, a rerun with other inputs or options is refused")
    run.add_argument("--skip-bad-files", action="store_true",
                     help="process the readable input files and list the others in "
                          "OUTPUT/_skipped.json instead of stopping")
    # The flags' defaults are the stages' (vLLM's SamplingParams defaults, greedy).
    defaults = STAGE_SAMPLING_DEFAULTS
    sampling = run.add_argument_group(
        "sampling defaults (rows may override with a sampling_params column)")
    sampling.add_argument("--max-tokens", type=int, default=defaults["max_tokens"],
                          help="most tokens to generate per row (default %(default)s)")
    sampling.add_argument("--temperature", type=float, default=defaults["temperature"],
                          help="0 = greedy (default %(default)s)")
    sampling.add_argument("--top-p", type=float, default=defaults["top_p"],
                          help="nucleus mass to keep, in (0, 1] (default %(default)s)")
    sampling.add_argument("--top-k", type=int, default=defaults["top_k"],
                          help="keep the k most likely tokens; 0 = off (default %(default)s)")
    sampling.add_argument("--seed", type=int, default=defaults["seed"],
                          help="sampling seed (default: unseeded)")
    sampling.add_argument("--stop", action="append", default=defaults["stop"],
                          help="a stop string (repeatable)")
    sampling.add_argument("--ignore-eos", action="store_true", default=defaults["ignore_eos"],
                          help="keep generating past end-of-sequence tokens")
    sampling.add_argument("--logprobs", type=int, default=defaults["logprobs"], metavar="K",
                          help="a logprobs column: each generated token's log-probability and the "
                               "K most likely tokens' (0-20)")
    sampling.add_argument("--prompt-logprobs", type=int, default=defaults["prompt_logprobs"], metavar="K",
                          help="a prompt_logprobs column, the same for each prompt token (0-20)")
    structured = run.add_argument_group(
        "structured outputs (rows may override with sampling_params.structured_outputs or "
        "guided_decoding)")
    constraint = structured.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", default=None, metavar="FILE|JSON",
                            help="outputs follow this JSON schema (a file, or the schema's text); "
                                 "for an object, a typed generated_json column is added")
    constraint.add_argument("--choice", default=None, metavar="A,B,C",
                            help="each output is exactly one of these comma-separated strings")
    constraint.add_argument("--regex", default=None, help="each output matches this regular expression")
    constraint.add_argument("--grammar", default=None, metavar="FILE|EBNF",
                            help="outputs follow this EBNF grammar (GBNF or Lark; a file, or its text)")
    structured.add_argument("--disable-any-whitespace", action="store_true",
                            help="JSON without whitespace between tokens (shorter; small models)")
    add_engine_flags(run)
    add_distributed_flags(run)
    run.add_argument("--fail-on-error", action="store_true",
                     help="stop at the first bad row instead of writing error rows")
    run_batch_command.add_parser(sub)
    return parser


def _structured_outputs(args: argparse.Namespace) -> dict | None:
    """The job-wide ``structured_outputs`` the flags ask for (validated by ``StageConfig``)."""
    if args.json_schema is not None:
        constraint = {"json": read_template(args.json_schema)}
    elif args.choice is not None:
        constraint = {"choice": [c for c in args.choice.split(",") if c]}
    elif args.regex is not None:
        constraint = {"regex": args.regex}
    elif args.grammar is not None:
        constraint = {"grammar": read_template(args.grammar)}
    else:
        return None
    if args.disable_any_whitespace:
        constraint["disable_any_whitespace"] = True
    return constraint


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; the exit status is 0, 2 (an error) or 130 (interrupted by Ctrl-C)."""
    with _sigint_honoured() as interrupted:
        try:
            code = _main(argv)
        except KeyboardInterrupt:  # after the job's own handling: while printing the summary
            code = 130
    return 130 if interrupted.is_set() else code


@contextlib.contextmanager
def _sigint_honoured():
    """A Ctrl-C anywhere in the run makes the exit status 130.

    The handler records the signal and raises ``KeyboardInterrupt`` in the main thread. Setting
    it also keeps ``asyncio.run`` from installing its own handler, which only cancels the main
    task and depends on every await on the way propagating that cancellation. The recorded flag
    covers a signal arriving after the job's work is done (while the summary is printed), where
    a ``KeyboardInterrupt`` would otherwise end in a traceback.
    """
    interrupted = threading.Event()

    def on_sigint(signum, frame):
        interrupted.set()
        raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():  # signals need the main thread
        yield interrupted
        return
    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield interrupted
    finally:
        signal.signal(signal.SIGINT, previous)


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        # The job's modules are imported inside the handlers: loading them takes seconds, and a
        # Ctrl-C meanwhile must end the same way as one during the job.
        if args.command == "run-batch":
            run_batch_command.run(args)
        else:
            _run(args)
    except BatchGenError as err:
        print(f"batchgen-data: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # the world's failures (a full disk, a file gone): one line, not a traceback
        where = f": {err.filename}" if err.filename else ""
        print(f"batchgen-data: error: {err.strerror or err}{where}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("batchgen-data: interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    return 0


def _run(args: argparse.Namespace) -> None:
    from batchgen_data.jobs.runner import run_job
    from batchgen_data.operators.rows import StageConfig

    stage = StageConfig(
        model=args.model,
        engine_config=engine_config_from(args),
        task_type=args.task,
        prompt_column=args.prompt_column,
        prompt_template=read_template(args.prompt_template),
        should_continue_on_error=not args.fail_on_error,
        sampling_params={**{name: getattr(args, name) for name in _SAMPLING_FLAGS},
                         "structured_outputs": _structured_outputs(args)},
        **chat_template_fields(args),
    )
    spec = job_spec_from(args, stage, input=args.input, output=args.output, output_format=args.output_format,
                         encoding=args.encoding, skip_bad_files=args.skip_bad_files)
    summary = run_job(spec)
    print(
        f"batchgen-data: {summary.num_rows} rows in {summary.num_parts} parts "
        f"({summary.num_parts_skipped} already done), {summary.num_error_rows} error rows, "
        f"{summary.num_output_tokens} output tokens, prefix cache hit "
        f"{summary.prefix_cache_hit_rate:.0%} of prompt tokens -> {args.output}"
    )
    if summary.usage is not None:
        print(f"batchgen-data: usage: {summary.usage.describe()} -> {args.output / USAGE}")
    for name in summary.empty_inputs:
        print(f"batchgen-data: {name} has zero rows")
    if summary.skipped_inputs:
        print(f"batchgen-data: skipped {len(summary.skipped_inputs)} input files that cannot be "
              f"read (listed in {args.output / '_skipped.json'}):")
        for bad in summary.skipped_inputs:
            print(f"  {bad.file}: {bad.reason}")


if __name__ == "__main__":
    sys.exit(main())
