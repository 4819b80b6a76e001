"""Ray Data LLM's processor API over this engine: ``build_processor(vLLMEngineProcessorConfig(...))``.

A Ray Data LLM pipeline

    from ray.data.llm import build_processor, vLLMEngineProcessorConfig
    processor = build_processor(vLLMEngineProcessorConfig(model_source=..., engine_kwargs=...,
                                batch_size=..., concurrency=...), preprocess=..., postprocess=...)
    ds = processor(ds)

switches by changing its import only:

    from batchgen_data import build_processor, vLLMEngineProcessorConfig

(``vLLMEngineProcessorConfig`` is ``BatchGenProcessorConfig``.) The processor is preprocess
(``ds.map``; what it returns is merged into the row, as in Ray Data LLM), one
``BatchGenOperator`` stage (the chat template, tokenizing, generating and detokenizing all happen
in the engine actor), then postprocess (``ds.map``; only what it returns is kept; error rows skip
it whole). Rows take Ray Data LLM's columns: ``messages`` or ``prompt`` (or ``tokenized_prompt`` /
``prompt_token_ids``) and a ``sampling_params`` dict with vLLM's names (``pooling_params`` for
``task_type`` embed / classify). Configs this engine does not run (HTTP, Serve, SGLang) go to Ray's
own ``build_processor``, so a file building one beside an engine processor keeps working.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from batchgen_data.engine_args import engine_config_fields, to_engine_config
from batchgen_data.engine.pooling_params import POOLING_TASKS
from batchgen_data.errors import ConfigError
from batchgen_data.stage_configs import (
    ChatTemplateStageConfig,
    DetokenizeStageConfig,
    PrepareMultimodalStageConfig,
    TokenizerStageConfig,
    resolve_stage,
)

TASK_TYPES = ("generate", *POOLING_TASKS)  # Ray's vLLMTaskType, less "score"
# Keys Ray's vLLM builder takes in ``builder_kwargs`` (the others are build_processor's own).
_BUILDER_KWARGS = frozenset({"chat_template_kwargs"})
_RESERVED_BUILDER_KWARGS = frozenset({"preprocess", "postprocess", "preprocess_map_kwargs", "postprocess_map_kwargs"})


@dataclass(slots=True)
class BatchGenProcessorConfig:
    """What ``build_processor`` builds: Ray Data LLM's ``vLLMEngineProcessorConfig``, field for
    field (plus ``num_cpus`` and ``rebalance``).

    Args:
        model_source (str, default "demo"): ``"demo"`` or a local checkpoint folder.
        engine_kwargs (dict): vLLM's engine arguments (``enable_chunked_prefill``,
            ``max_model_len``, ``enforce_eager``, ...) or ``EngineConfig`` fields
            (``expert_parallel_size``, ...); each is mapped, accepted as a no-op or refused as in
            ``engine_args.ENGINE_ARGS`` (docs/engine-kwargs.md). Any dict is accepted here, as in
            Ray Data LLM; ``build_processor`` raises ``ConfigError`` for an unknown key or a value
            this engine cannot honour, naming what to use instead.
        task_type (str, default "generate"): ``"generate"``, ``"embed"`` or ``"classify"``
            (vLLM's pooling: an ``embeddings`` column; rows may carry ``pooling_params``).
        batch_size (int, default 32): rows per batch sent to an engine actor.
        concurrency (int | tuple[int, int], default 1): engine actors, a fixed count or a
            (min, max) autoscaling range (Ray autoscales an int n from 1 to n; a fixed pool here,
            so work can be rebalanced between the actors from the start).
        max_concurrent_batches (int, default 8): batches in flight per actor (they feed one
            running set).
        max_tasks_in_flight_per_actor (int | None, default None): passed to Ray Data's
            ``ActorPoolStrategy``, as in Ray.
        max_pending_requests (int | None, default None): accepted; the engine's queue is fed by
            the batches in flight (``max_concurrent_batches``), which bound it.
        should_continue_on_error (bool, default False): a bad row becomes a row with
            ``__inference_error__`` instead of failing the job.
        chat_template_stage (bool | dict | ChatTemplateStageConfig, default True): render
            ``messages`` with the chat template (``chat_template``, ``chat_template_kwargs``,
            ``model_source``). False: rows carry a ``prompt`` or token ids.
        tokenize_stage (bool | dict | TokenizerStageConfig, default True): accepted; the engine
            tokenizes.
        detokenize_stage (bool | dict | DetokenizeStageConfig, default True): every row gets its
            ``generated_text``, even with ``detokenize=False`` in its ``sampling_params`` (Ray
            decodes the tokens in this stage); False: the engine's text, as the row asks.
        prepare_multimodal_stage (bool | dict | PrepareMultimodalStageConfig, default False):
            enabling it is refused (text-only models).
        runtime_env (dict | None), accelerator_type (str | None): for the engine actors.
        log_engine_metrics (bool, default True): accepted; the engine's counters are read with
            ``Engine.stats()`` and the stage's stats report, not Prometheus.
        dynamic_lora_loading_path (str | None): refused unless None when the processor is built
            (no LoRA adapters).
        placement_group_config (dict | None): with ``expert_parallel_size`` N > 1, the
            placement group of each engine's rank actors: ``bundles`` (N equal bundles, or one)
            or ``bundle_per_worker`` is one rank's (``EngineConfig.rank_resources``) and
            ``strategy`` the group's (``EngineConfig.placement_strategy``). With one rank, one
            bundle is accepted (the engine is one actor, sized by ``num_cpus`` /
            ``accelerator_type``); other shapes are refused when the processor is built.
        experimental (dict | None): older Ray's home of ``max_tasks_in_flight_per_actor``.
        model (str | None): older Ray's name for ``model_source``.
        resources_per_bundle (dict | None): older Ray's engine bundle; accepted, as
            ``placement_group_config`` with one bundle.
        apply_chat_template, tokenize, detokenize, chat_template, has_image, prepare_image_stage
            (legacy Ray Data LLM fields, default None): set the stage configs as older Ray did
            (``has_image=True`` and an enabled ``prepare_image_stage`` are the multimodal stage,
            refused).
        num_cpus (float | None, default None): CPUs per engine actor (default: half of what
            leaves one CPU of the cluster to Ray Data's own tasks, at most 1, so a second
            processor in the pipeline has room).
        rebalance (bool | None, default None): share work between the engine actors (see
            ``BatchGenOperator``); None turns it on with more than one actor.

    Example:
        >>> BatchGenProcessorConfig(model_source="demo", engine_kwargs={"max_num_seqs": 64}).batch_size
        32
    """

    model_source: str = "demo"
    engine_kwargs: dict = field(default_factory=dict)
    task_type: str = "generate"
    batch_size: int = 32
    concurrency: int | tuple[int, int] = 1
    max_concurrent_batches: int = 8
    max_tasks_in_flight_per_actor: int | None = None
    max_pending_requests: int | None = None
    should_continue_on_error: bool = False
    chat_template_stage: Any = True
    tokenize_stage: Any = True
    detokenize_stage: Any = True
    prepare_multimodal_stage: Any = False
    runtime_env: dict | None = None
    accelerator_type: str | None = None
    log_engine_metrics: bool = True
    dynamic_lora_loading_path: str | None = None
    placement_group_config: dict | None = None
    experimental: dict | None = None
    resources_per_bundle: dict | None = None
    model: str | None = None
    prepare_image_stage: Any = None
    apply_chat_template: bool | None = None
    tokenize: bool | None = None
    detokenize: bool | None = None
    chat_template: str | None = None
    has_image: bool | None = None
    num_cpus: float | None = None
    rebalance: bool | None = None

    def __post_init__(self) -> None:
        # engine_kwargs are checked by build_processor: Ray's docs declare configs (LoRA, tensor
        # parallel) beside the one they run, and declaring one must not fail.
        if not isinstance(self.engine_kwargs, dict):
            raise ConfigError(f"engine_kwargs must be a dict, got {type(self.engine_kwargs).__name__}")
        if self.task_type not in TASK_TYPES:
            raise ConfigError(f"task_type must be one of {TASK_TYPES}, got {self.task_type!r}")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ConfigError(f"batch_size must be an int >= 1, got {self.batch_size!r}")
        self.actor_range()  # validates concurrency
        self.chat_template_stage = resolve_stage(self.chat_template_stage, ChatTemplateStageConfig,
                                                 "chat_template_stage")
        self.tokenize_stage = resolve_stage(self.tokenize_stage, TokenizerStageConfig, "tokenize_stage")
        self.detokenize_stage = resolve_stage(self.detokenize_stage, DetokenizeStageConfig, "detokenize_stage")
        self.prepare_multimodal_stage = resolve_stage(self.prepare_multimodal_stage, PrepareMultimodalStageConfig,
                                                      "prepare_multimodal_stage")
        self._apply_legacy_fields()
        for name in ("max_concurrent_batches", "max_tasks_in_flight_per_actor", "max_pending_requests"):
            value = getattr(self, name)
            if (value is not None or name == "max_concurrent_batches") and (
                    isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name} must be an int >= 1, got {value!r}")

    def _apply_legacy_fields(self) -> None:
        """Older Ray Data LLM's flat fields, as it read them, onto the stage configs."""
        if self.model is not None:
            self.model_source = self.model
        if self.apply_chat_template is not None:
            self.chat_template_stage.enabled = bool(self.apply_chat_template)
        if self.chat_template is not None:
            self.chat_template_stage.chat_template = self.chat_template
        if self.tokenize is not None:
            self.tokenize_stage.enabled = bool(self.tokenize)
        if self.detokenize is not None:
            self.detokenize_stage.enabled = bool(self.detokenize)
        if self.has_image is not None:
            self.prepare_multimodal_stage.enabled = bool(self.has_image)
        if self.prepare_image_stage is not None:
            image = resolve_stage(self.prepare_image_stage, PrepareMultimodalStageConfig, "prepare_image_stage")
            self.prepare_multimodal_stage.enabled |= image.enabled
        experimental = self.experimental or {}
        if not isinstance(experimental, dict):
            raise ConfigError(f"experimental must be a dict, got {type(experimental).__name__}")
        if self.max_tasks_in_flight_per_actor is None and "max_tasks_in_flight_per_actor" in experimental:
            self.max_tasks_in_flight_per_actor = experimental["max_tasks_in_flight_per_actor"]

    def actor_range(self) -> tuple[int, int]:
        """(min, max) engine actors."""
        value = self.concurrency
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value, value
        if (isinstance(value, (tuple, list)) and len(value) == 2 and all(isinstance(v, int) for v in value)
                and 1 <= value[0] <= value[1]):
            return int(value[0]), int(value[1])
        raise ConfigError(f"concurrency must be an int >= 1 or a (min, max) pair, got {value!r}")

    def engine_kwargs_here(self) -> dict:
        """``engine_kwargs`` less ``task_type`` (Ray copies the config's there; the config's wins)."""
        return {k: v for k, v in self.engine_kwargs.items() if k != "task_type"}

    def check(self) -> None:
        """What ``build_processor`` refuses (``ConfigError``): engine_kwargs, and the fields this
        engine cannot honour."""
        to_engine_config(self.engine_kwargs_here(), self.model_source)
        if self.prepare_multimodal_stage.enabled:
            raise ConfigError("prepare_multimodal_stage / has_image: multimodal input is not supported here; "
                              "use a text-only model and text rows")
        if self.dynamic_lora_loading_path is not None:
            raise ConfigError("dynamic_lora_loading_path: LoRA adapters are not supported here; merge the adapter "
                              "into the checkpoint and give that folder as model_source")
        unknown = sorted(set(self.experimental or {}) - {"max_tasks_in_flight_per_actor"})
        if unknown:
            raise ConfigError(f"unknown experimental keys {unknown}; known: ['max_tasks_in_flight_per_actor']")
        self.rank_placement()

    def rank_placement(self) -> dict:
        """The ``EngineConfig`` fields ``placement_group_config`` sets for expert-parallel ranks
        (``rank_resources``, ``placement_strategy``): with ``expert_parallel_size`` N > 1 its
        bundles are the ranks' (N equal bundles, one bundle, or ``bundle_per_worker``); with one
        rank, one bundle is the engine actor's, as before. Anything else is a ``ConfigError``."""
        group = self.placement_group_config or {}
        config = to_engine_config(self.engine_kwargs_here(), self.model_source)
        ranks = config.expert_parallel_size
        bundles = group.get("bundles")
        if group.get("bundle_per_worker") is not None:
            bundles = [group["bundle_per_worker"]]
        if bundles is not None and len(bundles) > 1 and (len(bundles) != ranks or any(b != bundles[0] for b in bundles)):
            raise ConfigError(f"placement_group_config with {len(bundles)} bundles: with expert_parallel_size={ranks} "
                              f"it takes {ranks} equal bundles (one per expert-parallel rank) or one; an engine "
                              "is one actor here, so tensor/pipeline parallel workers have no bundles (use "
                              "engine_kwargs expert_parallel_size=N for expert parallelism)")
        if ranks == 1:
            return {}
        fields: dict[str, Any] = {}
        if bundles:
            fields["rank_resources"] = dict(bundles[0])
        if group.get("strategy") is not None:
            fields["placement_strategy"] = group["strategy"]
        replace(config, **fields)  # a strategy or bundle EngineConfig refuses fails when the processor is built
        return fields

    def operator_kwargs(self, chat_template_kwargs: dict | None = None) -> dict:
        """``BatchGenOperator`` constructor arguments for this config (``chat_template_kwargs``:
        ``build_processor``'s ``builder_kwargs`` fallback, as in Ray)."""
        chat = self.chat_template_stage
        kwargs: dict[str, Any] = {
            "model": chat.model_source or self.model_source,
            "engine_config": {**engine_config_fields(self.engine_kwargs_here(), self.model_source),
                              **self.rank_placement()},
            "should_continue_on_error": self.should_continue_on_error,
            "chat_template": chat.chat_template,
            "chat_template_kwargs": chat.chat_template_kwargs if chat.chat_template_kwargs is not None
            else chat_template_kwargs,
        }
        if self.task_type != "generate":
            kwargs["task_type"] = self.task_type
        if not chat.enabled:  # no template: rows carry their prompt text or token ids
            kwargs["apply_chat_template"] = False
        if self.detokenize_stage.enabled:  # Ray's detokenize stage decodes every row's tokens
            kwargs["detokenize_outputs"] = True
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
                 postprocess_map_kwargs: dict | None = None, chat_template_kwargs: dict | None = None):
        self.config = config
        self.preprocess = preprocess
        self.postprocess = postprocess
        self.preprocess_map_kwargs = dict(preprocess_map_kwargs or {})
        self.postprocess_map_kwargs = dict(postprocess_map_kwargs or {})
        self.chat_template_kwargs = chat_template_kwargs

    def __call__(self, dataset):
        import ray

        from batchgen_data.operators import BatchGenOperator

        if self.preprocess is not None:
            dataset = dataset.map(_MergeInto(self.preprocess), **self.preprocess_map_kwargs)
        low, high = self.config.actor_range()
        pool = ray.data.ActorPoolStrategy(min_size=low, max_size=high,
                                          max_concurrent_calls_per_actor=self.config.max_concurrent_batches,
                                          max_tasks_in_flight_per_actor=self.config.max_tasks_in_flight_per_actor)
        options: dict[str, Any] = {"num_cpus": self.config.num_cpus or _default_cpus(high)}
        if self.config.runtime_env is not None:
            options["runtime_env"] = self.config.runtime_env
        if self.config.accelerator_type is not None:
            options.update(accelerator_type=self.config.accelerator_type, num_gpus=1)
        operator_kwargs = self.config.operator_kwargs(self.chat_template_kwargs)
        dataset = dataset.map_batches(BatchGenOperator,
                                      fn_constructor_kwargs=operator_kwargs,
                                      # Arrow batches: every output column keeps its Arrow type (logprobs too)
                                      batch_size=self.config.batch_size, batch_format="pyarrow",
                                      compute=pool, **options)
        # as Ray's: always a postprocess (identity by default), which error rows skip
        return dataset.map(_PostprocessPassingErrors(self.postprocess, self.config.should_continue_on_error),
                           **self.postprocess_map_kwargs)

    def log_input_column_names(self) -> None:
        """Log the columns the engine stage reads (Ray Data LLM's method)."""
        import logging

        if self.config.task_type == "generate":
            needed = "messages (chat, when chat_template_stage is on), or prompt, or tokenized_prompt; sampling_params"
        else:
            needed = "messages, prompt or tokenized_prompt; optional pooling_params"
        logging.getLogger(__name__).info("The first stage of the processor is BatchGenOperator.\nInput columns: %s",
                                         needed)


def build_processor(config, preprocess: Callable[[dict], dict] | None = None,
                    postprocess: Callable[[dict], dict] | None = None, preprocess_map_kwargs: dict | None = None,
                    postprocess_map_kwargs: dict | None = None, builder_kwargs: dict | None = None):
    """A ``Processor`` for ``config`` (Ray Data LLM's ``ray.data.llm.build_processor``).

    Args:
        config: ``vLLMEngineProcessorConfig`` (ours, ``BatchGenProcessorConfig``; Ray's is read
            field for field). Ray's other configs (``HttpRequestProcessorConfig``,
            ``ServeDeploymentProcessorConfig``, ``SGLangEngineProcessorConfig``) are built by
            Ray's own ``build_processor``.
        preprocess: row -> dict merged into the row (give ``messages`` or ``prompt``, and
            ``sampling_params``).
        postprocess: row -> the output row (the generated columns are in it); error rows skip it.
        preprocess_map_kwargs, postprocess_map_kwargs: extra ``Dataset.map`` arguments.
        builder_kwargs: as Ray's: ``chat_template_kwargs`` (used where the chat template stage
            gives none).

    Example:
        >>> processor = build_processor(BatchGenProcessorConfig(model_source="demo"))
        >>> type(processor).__name__
        'Processor'
    """
    builder_kwargs = dict(builder_kwargs or {})
    reserved = sorted(_RESERVED_BUILDER_KWARGS & builder_kwargs.keys())
    if reserved:
        raise ConfigError(f"builder_kwargs cannot contain {reserved}: pass them to build_processor directly")
    if _is_rays_vllm_config(config):
        config = BatchGenProcessorConfig(**_fields_of_rays(config))
    if not isinstance(config, BatchGenProcessorConfig):
        if type(config).__module__.startswith("ray."):
            from ray.data.llm import build_processor as rays_build_processor

            return rays_build_processor(config, preprocess, postprocess, preprocess_map_kwargs,
                                        postprocess_map_kwargs, builder_kwargs or None)
        raise ConfigError(f"config must be a vLLMEngineProcessorConfig (BatchGenProcessorConfig) or one of Ray "
                          f"Data LLM's processor configs, got {type(config).__name__}")
    unknown = sorted(builder_kwargs.keys() - _BUILDER_KWARGS)
    if unknown:
        raise ConfigError(f"unknown builder_kwargs {unknown}; known: {sorted(_BUILDER_KWARGS)}")
    config.check()
    return Processor(config, preprocess, postprocess, preprocess_map_kwargs, postprocess_map_kwargs,
                     builder_kwargs.get("chat_template_kwargs"))


# Older Ray Data LLM's name for build_processor.
build_llm_processor = build_processor


def _is_rays_vllm_config(config: Any) -> bool:
    return type(config).__name__ == "vLLMEngineProcessorConfig" and type(config).__module__.startswith("ray.")


def _fields_of_rays(config: Any) -> dict:
    """A Ray ``vLLMEngineProcessorConfig``'s fields that ours has (they all are, but Ray may add)."""
    ours = set(BatchGenProcessorConfig.__dataclass_fields__)
    values = {k: v for k, v in config.model_dump().items() if k in ours}
    for stage in ("chat_template_stage", "tokenize_stage", "detokenize_stage", "prepare_multimodal_stage"):
        value = getattr(config, stage, None)
        if value is not None and hasattr(value, "model_dump"):
            values[stage] = value.model_dump()
    return values


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
    ``__inference_error__`` ``""`` when the job continues on errors (Ray's one schema), or whole
    without one, its ``__inference_error__`` ``""`` as Ray's engine stage writes it."""

    def __init__(self, fn: Callable[[dict], dict] | None, include_error_column: bool):
        self.fn = fn
        self.include_error_column = include_error_column

    def __call__(self, row: dict) -> dict:
        from batchgen_data.operators.columns import ERROR_COLUMN

        if row.get(ERROR_COLUMN) not in (None, ""):
            return row
        if self.fn is None:
            return {**row, ERROR_COLUMN: ""}
        result = self.fn(row)
        if self.include_error_column:
            result[ERROR_COLUMN] = ""
        return result


def _default_cpus(num_actors: int) -> float:
    """Leave a CPU for Ray Data's read and bookkeeping tasks, and half of the rest for a second
    processor's actors in the same pipeline (chained processors): whole-CPU actors on a small
    machine starve them and the pipeline hangs without an error. (Ray's accounting only: an
    actor's torch threads are not bounded by it.)"""
    import ray

    total = ray.cluster_resources().get("CPU", 1) if ray.is_initialized() else 2
    return max(0.25, min(1.0, (total - 1) / num_actors / 2))
