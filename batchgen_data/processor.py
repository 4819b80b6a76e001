"""Ray Data LLM's processor API over this engine: ``build_processor(BatchGenProcessorConfig(...))``.

A Ray Data LLM pipeline

    from ray.data.llm import build_processor, vLLMEngineProcessorConfig
    processor = build_processor(vLLMEngineProcessorConfig(model_source=..., engine_kwargs=...,
                                batch_size=..., concurrency=...), preprocess=..., postprocess=...)
    ds = processor(ds)

switches by changing its import and its config class:

    from batchgen_data import build_processor, BatchGenProcessorConfig

The processor is preprocess (``ds.map``; what it returns is merged into the row, as in Ray Data
LLM), one ``BatchGenOperator`` stage (the chat template, tokenizing, generating and detokenizing
all happen in the engine), then postprocess (``ds.map``; only what it returns is kept). Rows take
Ray Data LLM's columns: ``messages`` or ``prompt`` (or ``tokenized_prompt`` / ``prompt_token_ids``)
and a ``sampling_params`` dict with vLLM's names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from batchgen_data.engine_args import engine_config_fields, to_engine_config
from batchgen_data.errors import ConfigError

# Keys a stage's dict may hold (Ray Data LLM's per-stage configs); for the chat template stage,
# also its template and kwargs.
_STAGE_KEYS = frozenset({"enabled", "batch_size", "concurrency", "runtime_env", "num_cpus", "memory"})
_CHAT_TEMPLATE_KEYS = _STAGE_KEYS | {"model_source", "chat_template", "chat_template_kwargs"}


@dataclass(slots=True)
class BatchGenProcessorConfig:
    """What ``build_processor`` builds, in Ray Data LLM's names (``vLLMEngineProcessorConfig``).

    Args:
        model_source (str, default "demo"): ``"demo"`` or a local checkpoint folder.
        engine_kwargs (dict): vLLM's engine arguments (``enable_chunked_prefill``,
            ``max_model_len``, ``enforce_eager``, ...) or ``EngineConfig`` fields
            (``expert_parallel_size``, ...); each is mapped, accepted as a no-op or refused as in
            ``engine_args.ENGINE_ARGS`` (docs/engine-kwargs.md). Any dict is accepted here, as in
            Ray Data LLM; ``build_processor`` raises ``ConfigError`` for an unknown key or a value
            this engine cannot honour, naming what to use instead.
        batch_size (int, default 32): rows per batch sent to an engine actor.
        concurrency (int | tuple[int, int], default 1): engine actors, a fixed count or a
            (min, max) autoscaling range.
        max_concurrent_batches (int, default 8): batches in flight per actor (they feed one
            running set).
        should_continue_on_error (bool, default False): a bad row becomes a row with
            ``__inference_error__`` instead of failing the job.
        chat_template_stage (bool | dict, default True): render ``messages`` with the chat
            template; a dict may give ``chat_template`` and ``chat_template_kwargs``. False:
            rows must carry a ``prompt`` or token ids.
        tokenize_stage, detokenize_stage (bool | dict, default True): accepted for
            compatibility; the engine always tokenizes prompts and detokenizes outputs.
        runtime_env (dict | None), accelerator_type (str | None): for the engine actors.
        num_cpus (float | None, default None): CPUs per engine actor (default: what leaves one
            CPU of the cluster to Ray Data's own tasks, at most 1).
        rebalance (bool | None, default None): share work between the engine actors (see
            ``BatchGenOperator``); None turns it on with more than one actor.

    Example:
        >>> BatchGenProcessorConfig(model_source="demo", engine_kwargs={"max_num_seqs": 64}).batch_size
        32
    """

    model_source: str = "demo"
    engine_kwargs: dict = field(default_factory=dict)
    batch_size: int = 32
    concurrency: int | tuple[int, int] = 1
    max_concurrent_batches: int = 8
    should_continue_on_error: bool = False
    chat_template_stage: bool | dict = True
    tokenize_stage: bool | dict = True
    detokenize_stage: bool | dict = True
    runtime_env: dict | None = None
    accelerator_type: str | None = None
    num_cpus: float | None = None
    rebalance: bool | None = None

    def __post_init__(self) -> None:
        # engine_kwargs are checked by build_processor: Ray's docs declare configs (LoRA, tensor
        # parallel) beside the one they run, and declaring one must not fail.
        if not isinstance(self.engine_kwargs, dict):
            raise ConfigError(f"engine_kwargs must be a dict, got {type(self.engine_kwargs).__name__}")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ConfigError(f"batch_size must be an int >= 1, got {self.batch_size!r}")
        self.actor_range()  # validates concurrency
        if not isinstance(self.max_concurrent_batches, int) or self.max_concurrent_batches < 1:
            raise ConfigError(f"max_concurrent_batches must be an int >= 1, got {self.max_concurrent_batches!r}")
        _stage(self.chat_template_stage, "chat_template_stage", _CHAT_TEMPLATE_KEYS)
        _stage(self.tokenize_stage, "tokenize_stage", _STAGE_KEYS)
        _stage(self.detokenize_stage, "detokenize_stage", _STAGE_KEYS)

    def actor_range(self) -> tuple[int, int]:
        """(min, max) engine actors."""
        value = self.concurrency
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value, value
        if (isinstance(value, (tuple, list)) and len(value) == 2 and all(isinstance(v, int) for v in value)
                and 1 <= value[0] <= value[1]):
            return int(value[0]), int(value[1])
        raise ConfigError(f"concurrency must be an int >= 1 or a (min, max) pair, got {value!r}")

    def operator_kwargs(self) -> dict:
        """``BatchGenOperator`` constructor arguments for this config."""
        chat = _stage(self.chat_template_stage, "chat_template_stage", _CHAT_TEMPLATE_KEYS)
        kwargs: dict[str, Any] = {
            "model": chat.get("model_source") or self.model_source,
            "engine_config": engine_config_fields(self.engine_kwargs, self.model_source),
            "should_continue_on_error": self.should_continue_on_error,
            "chat_template": chat.get("chat_template"),
            "chat_template_kwargs": chat.get("chat_template_kwargs"),
        }
        if not chat.get("enabled", True):  # no template: rows carry their prompt text or token ids
            kwargs["apply_chat_template"] = False
        rebalance = self.rebalance
        if rebalance is None:
            rebalance = self.actor_range()[1] > 1
        kwargs["rebalance"] = rebalance
        return kwargs


# Ray Data LLM's name for this config: a pipeline switches by changing only its import.
vLLMEngineProcessorConfig = BatchGenProcessorConfig


class Processor:
    """``processor(dataset) -> dataset``: preprocess, generate, postprocess (lazily, as Ray Data
    LLM's ``Processor``)."""

    def __init__(self, config: BatchGenProcessorConfig, preprocess: Callable[[dict], dict] | None = None,
                 postprocess: Callable[[dict], dict] | None = None, preprocess_map_kwargs: dict | None = None,
                 postprocess_map_kwargs: dict | None = None):
        self.config = config
        self.preprocess = preprocess
        self.postprocess = postprocess
        self.preprocess_map_kwargs = dict(preprocess_map_kwargs or {})
        self.postprocess_map_kwargs = dict(postprocess_map_kwargs or {})

    def __call__(self, dataset):
        import ray

        from batchgen_data.operators import BatchGenOperator

        if self.preprocess is not None:
            dataset = dataset.map(_MergeInto(self.preprocess), **self.preprocess_map_kwargs)
        low, high = self.config.actor_range()
        pool = ray.data.ActorPoolStrategy(min_size=low, max_size=high,
                                          max_concurrent_calls_per_actor=self.config.max_concurrent_batches)
        options: dict[str, Any] = {"num_cpus": self.config.num_cpus or _default_cpus(high)}
        if self.config.runtime_env is not None:
            options["runtime_env"] = self.config.runtime_env
        if self.config.accelerator_type is not None:
            options.update(accelerator_type=self.config.accelerator_type, num_gpus=1)
        dataset = dataset.map_batches(BatchGenOperator, fn_constructor_kwargs=self.config.operator_kwargs(),
                                      # numpy batches: rows get Ray Data LLM's logprob dicts
                                      batch_size=self.config.batch_size, batch_format="numpy",
                                      compute=pool, **options)
        if self.postprocess is not None:
            dataset = dataset.map(_PostprocessPassingErrors(self.postprocess, self.config.should_continue_on_error),
                                  **self.postprocess_map_kwargs)
        return dataset


def build_processor(config: BatchGenProcessorConfig, preprocess: Callable[[dict], dict] | None = None,
                    postprocess: Callable[[dict], dict] | None = None, preprocess_map_kwargs: dict | None = None,
                    postprocess_map_kwargs: dict | None = None) -> Processor:
    """A ``Processor`` for ``config`` (Ray Data LLM's ``ray.data.llm.build_processor``).

    Args:
        config: the engine and its actors.
        preprocess: row -> dict merged into the row (give ``messages`` or ``prompt``, and
            ``sampling_params``).
        postprocess: row -> the output row (the generated columns are in it).
        preprocess_map_kwargs, postprocess_map_kwargs: extra ``Dataset.map`` arguments.

    Example:
        >>> processor = build_processor(BatchGenProcessorConfig(model_source="demo"))
        >>> type(processor).__name__
        'Processor'
    """
    if not isinstance(config, BatchGenProcessorConfig):
        raise ConfigError(f"config must be a BatchGenProcessorConfig, got {type(config).__name__}")
    to_engine_config(config.engine_kwargs, config.model_source)  # unknown or refused engine_kwargs fail here
    return Processor(config, preprocess, postprocess, preprocess_map_kwargs, postprocess_map_kwargs)


class _MergeInto:
    """Preprocess as Ray Data LLM applies it: its output is merged into the row."""

    def __init__(self, fn: Callable[[dict], dict]):
        self.fn = fn

    def __call__(self, row: dict) -> dict:
        return {**row, **self.fn(row)}


class _PostprocessPassingErrors:
    """Postprocess as Ray Data LLM applies it: an error row skips it and comes out whole, its
    ``__inference_error__`` kept (a user's postprocess would drop the error or fail on the
    missing outputs); a success row comes out as postprocess returns it, with
    ``__inference_error__`` set to ``""`` when the job continues on errors (Ray's one schema)."""

    def __init__(self, fn: Callable[[dict], dict], include_error_column: bool):
        self.fn = fn
        self.include_error_column = include_error_column

    def __call__(self, row: dict) -> dict:
        from batchgen_data.operators.columns import ERROR_COLUMN

        if row.get(ERROR_COLUMN) not in (None, ""):
            return row
        result = self.fn(row)
        if self.include_error_column:
            result[ERROR_COLUMN] = ""
        return result


def _stage(value: bool | dict, name: str, keys: frozenset[str]) -> dict:
    if isinstance(value, bool):
        return {"enabled": value}
    if not isinstance(value, dict):
        raise ConfigError(f"{name} must be a bool or a dict, got {type(value).__name__}")
    unknown = sorted(set(value) - keys)
    if unknown:
        raise ConfigError(f"unknown {name} keys {unknown}; known: {sorted(keys)}")
    return value


def _default_cpus(num_actors: int) -> float:
    """Leave a CPU for Ray Data's read and bookkeeping tasks: whole-CPU actors on a small machine
    starve them and the pipeline hangs without an error."""
    import ray

    total = ray.cluster_resources().get("CPU", 1) if ray.is_initialized() else 2
    return max(0.25, min(1.0, (total - 1) / num_actors))
