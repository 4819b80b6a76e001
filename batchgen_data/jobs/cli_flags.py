"""Flags the ``run`` and ``run-batch`` subcommands share (the engine's, and Ray's), their
defaults taken from the dataclasses they fill (a default changed there changes here), and the
``EngineConfig`` they give."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

from batchgen_data.config import EXPERT_BACKENDS, PLACEMENT_STRATEGIES, EngineConfig
from batchgen_data.errors import ConfigError
from batchgen_data.jobs.job_spec import JobSpec
from batchgen_data.jobs.sizes import parse_byte_size
from batchgen_data.operators.rows import StageConfig

ENGINE_DEFAULTS = {f.name: f.default for f in fields(EngineConfig)}
STAGE_DEFAULTS = {f.name: f.default for f in fields(StageConfig)}
JOB_DEFAULTS = {f.name: f.default for f in fields(JobSpec)}


def add_chat_template_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chat-template", default=None, metavar="FILE|JINJA",
                        help="a chat template for messages, replacing the tokenizer's (a file, or its text)")
    parser.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                        help='arguments for the chat template, e.g. \'{"enable_thinking": false}\'')


def chat_template_fields(args: argparse.Namespace) -> dict:
    """``StageConfig``'s ``chat_template`` and ``chat_template_kwargs`` from their flags."""
    from batchgen_data.engine.structured.params import parse_json_object

    kwargs = args.chat_template_kwargs
    return {"chat_template": read_template(args.chat_template),
            "chat_template_kwargs": None if kwargs is None else parse_json_object(kwargs, "--chat-template-kwargs")}


def add_job_flags(parser: argparse.ArgumentParser) -> None:
    """Flags of how a job's parts run, not of what they give (``JobSpec``'s)."""
    parser.add_argument("--rows-per-part", type=int, default=JOB_DEFAULTS["rows_per_part"],
                        help="rows per part file (default %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def job_spec_from(args: argparse.Namespace, stage: StageConfig, **fields):
    """The ``JobSpec`` the job and distributed flags ask for (``fields``: the rest of it)."""
    from batchgen_data.errors import BatchGenError

    if args.rows_per_part < 1 or args.workers < 1:
        raise BatchGenError(f"--rows-per-part and --workers must be >= 1, got {args.rows_per_part} and {args.workers}")
    return JobSpec(stage=stage, rows_per_part=args.rows_per_part, workers=args.workers, address=args.address,
                   batch_size=args.batch_size, max_concurrent_batches=args.max_concurrent_batches,
                   cpus_per_worker=args.cpus_per_worker, show_progress=not args.no_progress,
                   overwrite=args.overwrite, **fields)


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    engine = parser.add_argument_group("engine")
    defaults = ENGINE_DEFAULTS
    engine.add_argument("--device", default=defaults["device"])
    engine.add_argument("--dtype", default=defaults["dtype"])
    engine.add_argument("--max-num-seqs", type=int, default=defaults["max_num_seqs"])
    engine.add_argument("--kv-cache-memory-bytes", type=int, default=defaults["kv_cache_memory_bytes"])
    engine.add_argument("--expert-backend", choices=EXPERT_BACKENDS, default=defaults["expert_backend"])
    engine.add_argument("--expert-parallel-size", type=int, default=defaults["expert_parallel_size"],
                        help="N > 1: spread the experts over N rank processes "
                             "(DeepSpeed-MoE all-to-all)")
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=defaults["enable_prefix_caching"],
                        help="rows sharing a prompt prefix share its KV (default on; "
                             "--no-enable-prefix-caching turns it off, as in vLLM)")
    engine.add_argument("--speculative-config", default=defaults["speculative_config"], metavar="JSON",
                        help='speculative decoding, as vLLM\'s --speculative-config: e.g. '
                             '\'{"method": "ngram", "num_speculative_tokens": 4}\' (tokens unchanged)')
    engine.add_argument("--weight-memory", type=byte_size, default=defaults["weight_memory_bytes"], metavar="SIZE",
                        help="memory for the model's weights, like 8GB or 512MiB (default: all "
                             "resident); the routed experts stream from the checkpoint through "
                             "what the dense weights leave")


def add_distributed_flags(parser: argparse.ArgumentParser) -> None:
    dist = parser.add_argument_group("distributed (Ray Data)")
    dist.add_argument("--workers", type=int, default=1,
                      help="N > 1: N engine actors through Ray Data")
    dist.add_argument("--address", default=None,
                      help="join this Ray cluster instead of starting one")
    dist.add_argument("--batch-size", type=int, default=64, help="rows per Ray Data batch")
    dist.add_argument("--max-concurrent-batches", type=int, default=4,
                      help="batches in flight per actor")
    dist.add_argument("--cpus-per-worker", type=float, default=None)
    dist.add_argument("--placement-strategy", choices=PLACEMENT_STRATEGIES,
                      default=ENGINE_DEFAULTS["placement_strategy"], help="with --expert-parallel-size N on Ray: how each engine's N rank "
                                           "actors are placed (one placement group per engine)")
    dist.add_argument("--cpus-per-rank", type=float, default=None,
                      help="with --expert-parallel-size N on Ray: CPUs in each rank's bundle (default 1 on "
                           "--address clusters; on the local Ray, a share of what the engine actors leave)")
    dist.add_argument("--gpus-per-rank", type=float, default=None,
                      help="GPUs in each rank's bundle (default 1 with --device cuda, else 0)")


def engine_config_from(args: argparse.Namespace) -> EngineConfig:
    """The ``EngineConfig`` the engine and distributed flags ask for."""
    from batchgen_data.engine.structured.params import parse_json_object

    return EngineConfig(device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=max(ENGINE_DEFAULTS["max_num_batched_tokens"], args.max_num_seqs),
                        kv_cache_memory_bytes=args.kv_cache_memory_bytes, expert_backend=args.expert_backend,
                        expert_parallel_size=args.expert_parallel_size, weight_memory_bytes=args.weight_memory,
                        enable_prefix_caching=args.enable_prefix_caching,
                        placement_strategy=args.placement_strategy, rank_resources=_rank_resources(args),
                        speculative_config=None if args.speculative_config is None else
                        parse_json_object(args.speculative_config, "--speculative-config"))


def _rank_resources(args) -> dict | None:
    """One rank's bundle from --cpus-per-rank / --gpus-per-rank (None: the engine's default)."""
    if args.cpus_per_rank is None and args.gpus_per_rank is None:
        return None
    gpus = args.gpus_per_rank if args.gpus_per_rank is not None else float(args.device.startswith("cuda"))
    bundle = {"CPU": 1.0 if args.cpus_per_rank is None else args.cpus_per_rank}
    return {**bundle, "GPU": gpus} if gpus else bundle


def byte_size(text: str) -> int:
    try:
        return parse_byte_size(text)
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def read_template(value: str | None) -> str | None:
    """A flag's text, or the file it names."""
    if value is not None and Path(value).is_file():
        return Path(value).read_text(encoding="utf-8")
    return value
