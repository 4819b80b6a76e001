"""Ray Data LLM's ``vLLMEngineProcessorConfig``, as this engine builds it.

``BatchGenProcessorConfig`` is a subclass of Ray's own pydantic model, so every field, type,
default, coercion (``concurrency="2"`` is 2) and ``pydantic.ValidationError`` is Ray's, with
``model_dump()`` and stage configs stored as given (a dict stays a dict). It adds ``num_cpus`` and
``rebalance``, takes the legacy flags Ray 2.53-2.58 took (``apply_chat_template``,
``chat_template``, ``tokenize``, ``detokenize``: turned into stage dicts, an explicit stage config
winning, with a logged deprecation) and refuses, as Ray 2.57+ does, ``has_image`` and
``prepare_image_stage`` (and, as 2.59+, ``model``, ``experimental``, ``resources_per_bundle``).

What only building can check (``engine_kwargs`` this engine cannot honour, an enabled multimodal
stage, LoRA, ``task_type="score"``) raises ``ConfigError`` from ``check`` when the processor is
built: Ray's docs declare configs beside the one they run, and declaring one must not fail.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import field_validator, model_validator
from ray.data.llm import vLLMEngineProcessorConfig as _RaysConfig

from batchgen_data.config.engine import EngineConfig
from batchgen_data.config.engine_args import engine_config_fields
from batchgen_data.config.ray_stages import STAGE_FIELDS, resolve_stage
from batchgen_data.config.tasks import TASK_TYPES
from batchgen_data.errors import ConfigError

logger = logging.getLogger(__name__)

# Ray 2.53-2.58's flat flags and the stage config each one sets (``enabled``), as Ray read them.
LEGACY_STAGE_FLAGS = {"tokenize": "tokenize_stage", "detokenize": "detokenize_stage"}
LEGACY_CHAT_FLAGS = ("apply_chat_template", "chat_template")


class BatchGenProcessorConfig(_RaysConfig):
    """What ``build_processor`` builds: Ray Data LLM's ``vLLMEngineProcessorConfig`` (a
    subclass of it), plus ``num_cpus`` and ``rebalance``.

    Fields as Ray's, with these meanings here:
        model_source (str): ``"demo"`` or a local checkpoint folder.
        engine_kwargs (dict): vLLM's engine arguments or ``EngineConfig`` fields, each mapped,
            accepted as a no-op or refused as ``engine_args.ENGINE_ARGS`` says
            (docs/engine-kwargs.md), when the processor is built.
        task_type (str, default "generate"): ``"generate"``, ``"embed"`` or ``"classify"``.
        concurrency (int | tuple[int, int], default 1): an int n is a fixed pool of n engine
            actors (Ray autoscales 1..n; a fixed pool lets work be rebalanced from the first
            batch), a (min, max) pair autoscales.
        max_concurrent_batches (int, default 8): batches in flight per actor (one running set).
        chat_template_stage, tokenize_stage, detokenize_stage, prepare_multimodal_stage: a bool,
            a dict or the stage's config; they run inside the engine actor. An enabled
            multimodal stage is refused (text-only models).
        max_pending_requests, log_engine_metrics: accepted, no-ops here.
        placement_group_config (dict | None): with ``expert_parallel_size`` N > 1, the bundles
            of each engine's rank actors (N equal bundles, one, or ``bundle_per_worker``) and
            their ``strategy``; with one rank, one bundle.
        num_cpus (float | None, default None): CPUs per engine actor (default: half of what
            leaves one CPU of the cluster to Ray Data's own tasks, at most 1).
        rebalance (bool | None, default None): share work between the engine actors; None turns
            it on with more than one actor.

    Example:
        >>> config = BatchGenProcessorConfig(model_source="demo", concurrency="2", tokenize=False)
        >>> config.concurrency, config.tokenize_stage
        (2, {'enabled': False})
    """

    num_cpus: float | None = None
    rebalance: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _legacy_flags(cls, values: Any) -> Any:
        """Ray 2.53-2.58's flat flags into stage dicts (an explicit stage config wins); and
        ``engine_kwargs`` copied, so Ray's validator, which writes ``task_type`` into it, leaves
        the caller's dict as it was."""
        if not isinstance(values, dict):
            return values
        values = dict(values)
        if isinstance(values.get("engine_kwargs"), dict):
            values["engine_kwargs"] = dict(values["engine_kwargs"])
        chat = {name: values.pop(name) for name in LEGACY_CHAT_FLAGS if name in values}
        if chat and "chat_template_stage" not in values:
            logger.warning("The `apply_chat_template` and `chat_template` fields are deprecated; use "
                           "`chat_template_stage` instead, e.g. chat_template_stage={'enabled': True}.")
            stage = {"enabled": True if chat.get("apply_chat_template") is None else chat["apply_chat_template"]}
            if chat.get("chat_template") is not None:
                stage["chat_template"] = chat["chat_template"]
            values["chat_template_stage"] = stage
        for flag, stage_field in LEGACY_STAGE_FLAGS.items():
            if flag not in values:
                continue
            value = values.pop(flag)
            if stage_field not in values:
                logger.warning("The `%s` field is deprecated; use `%s` instead, e.g. %s={'enabled': True}.",
                               flag, stage_field, stage_field)
                values[stage_field] = {"enabled": True if value is None else value}
        return values

    @field_validator("batch_size", "max_concurrent_batches")
    @classmethod
    def _at_least_one(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"must be an int >= 1, got {value!r}")
        return value

    @field_validator("max_tasks_in_flight_per_actor", "max_pending_requests")
    @classmethod
    def _none_or_at_least_one(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"must be None or an int >= 1, got {value!r}")
        return value

    @field_validator("num_cpus")
    @classmethod
    def _positive_cpus(cls, value: float | None) -> float | None:
        if value is not None and not value > 0:
            raise ValueError(f"must be None or > 0, got {value!r}")
        return value

    def stage(self, name: str):
        """The stage config ``name`` (``"chat_template_stage"``, ...) resolved to its class (a
        new object; the field keeps what was given)."""
        return resolve_stage(getattr(self, name), STAGE_FIELDS[name])

    def actor_pool(self) -> dict[str, int]:
        """Ray Data ``ActorPoolStrategy`` sizes: ``{"size": n}`` for an int, else min and max."""
        return self.get_concurrency(autoscaling_enabled=False)

    def engine_kwargs_here(self) -> dict:
        """``engine_kwargs`` less ``task_type`` (Ray copies the config's there; the config's wins)."""
        return {k: v for k, v in self.engine_kwargs.items() if k != "task_type"}

    def check(self) -> dict:
        """What ``build_processor`` refuses (``ConfigError``): engine_kwargs, and the fields this
        engine cannot honour. Returns ``engine_fields()``, mapped once for the build."""
        if self.task_type not in TASK_TYPES:
            raise ConfigError(f"task_type={self.task_type!r} is not supported here; use one of {TASK_TYPES}")
        fields = self.engine_fields()
        for name in STAGE_FIELDS:
            self.stage(name)  # a bad stage config fails here (ValidationError, TypeError)
        if self.stage("prepare_multimodal_stage").enabled:
            raise ConfigError("prepare_multimodal_stage: multimodal input is not supported here; use a text-only "
                              "model and text rows")
        if self.dynamic_lora_loading_path is not None:
            raise ConfigError("dynamic_lora_loading_path: LoRA adapters are not supported here; merge the adapter "
                              "into the checkpoint and give that folder as model_source")
        return fields

    def engine_fields(self) -> dict:
        """The ``EngineConfig`` fields this config sets: ``engine_kwargs`` mapped (vLLM's names,
        ``engine_args.py``) and ``placement_group_config``'s (``rank_placement``), checked by
        building the ``EngineConfig`` once (``ConfigError``)."""
        fields = engine_config_fields(self.engine_kwargs_here(), self.model_source)
        fields.update(self.rank_placement(fields.get("expert_parallel_size", 1)))
        EngineConfig(**fields)  # a value, strategy or bundle EngineConfig refuses fails when the processor is built
        return fields

    def rank_placement(self, expert_parallel_size: int | None = None) -> dict:
        """The ``EngineConfig`` fields ``placement_group_config`` sets for expert-parallel ranks
        (``rank_resources``, ``placement_strategy``): with ``expert_parallel_size`` N > 1 its
        bundles are the ranks' (N equal bundles, one bundle, or ``bundle_per_worker``); with one
        rank, one bundle is the engine actor's. Anything else is a ``ConfigError``.
        ``expert_parallel_size`` None reads it from ``engine_kwargs``."""
        group = self.placement_group_config or {}
        ranks = expert_parallel_size
        if ranks is None:
            ranks = engine_config_fields(self.engine_kwargs_here(), self.model_source).get("expert_parallel_size", 1)
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
        return fields

    def operator_kwargs(self, chat_template_kwargs: dict | None = None, engine_fields: dict | None = None) -> dict:
        """``BatchGenOperator`` constructor arguments for this config (``chat_template_kwargs``:
        ``build_processor``'s ``builder_kwargs`` fallback, as in Ray; ``engine_fields``: what
        ``check()`` returned, else mapped here)."""
        chat = self.stage("chat_template_stage")
        kwargs: dict[str, Any] = {
            "model": chat.model_source or self.model_source,
            "engine_config": dict(self.engine_fields() if engine_fields is None else engine_fields),
            "should_continue_on_error": self.should_continue_on_error,
            "chat_template": chat.chat_template,
            "chat_template_kwargs": chat.chat_template_kwargs if chat.chat_template_kwargs is not None
            else chat_template_kwargs,
        }
        if self.task_type != "generate":
            kwargs["task_type"] = self.task_type
        if not chat.enabled:  # no template: rows carry their prompt text or token ids
            kwargs["apply_chat_template"] = False
        if self.stage("detokenize_stage").enabled:  # Ray's detokenize stage decodes every row's tokens
            kwargs["detokenize_outputs"] = True
        rebalance = self.rebalance
        if rebalance is None:
            rebalance = max(self.actor_pool().values()) > 1
        kwargs["rebalance"] = rebalance
        return kwargs


# Ray Data LLM's name for this config: a pipeline switches by changing only its import.
vLLMEngineProcessorConfig = BatchGenProcessorConfig
